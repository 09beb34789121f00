"""The Ray layer: the only package that imports Ray. The Ray backend (engines as actors), the
actor groups the loops talk to, weight-sync strategies between actors, and the cluster."""
