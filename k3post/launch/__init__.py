"""The launch layer (no Ray): a recipe becomes engines over a backend and the loop's run object."""
