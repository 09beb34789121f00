"""k3post: multi-teacher reverse-KL on-policy distillation, after the Kimi K3 recipe.

The package root imports nothing heavy: `import k3post` never pulls in Ray, vLLM or
transformers. See docs/architecture.md for the layers.
"""

__version__ = "0.1.0"
