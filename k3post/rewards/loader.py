"""Loading reward functions named by a recipe: "rewards.math:correctness" → the callable.

A target is `<module>:<function>`. The module is looked up, in order:

1. as a file under `root` (default: the current directory, i.e. the repository or the Ray job's
   working dir): "rewards.mine:f" loads `<root>/rewards/mine.py`. This is how a user's own
   `rewards/<module>.py` wins over the copy shipped inside an installed k3post (the console
   script's sys.path does not contain the current directory);
2. as any importable module path (`rewards.math` shipped with k3post, `mypkg.scoring`, ...);
3. a path ending in ".py" ("path/to/file.py:f") is loaded from that file.

Every failure is a UserError that names the target: malformed target, missing module, an error
raised while importing it, missing attribute, not callable.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from k3post.config.errors import UserError
from k3post.config.suggest import did_you_mean
from k3post.rewards.protocol import RewardSpec


def _load_file(module_name: str, path: Path, target: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise UserError(f"reward {target!r}: cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    # Registered before executing, like a normal import, so dataclasses/pickle can find it.
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        sys.modules.pop(module_name, None)
        raise UserError(f"reward {target!r}: importing {path} failed: {type(error).__name__}: {error}") from error
    return module


def _import(module_name: str, target: str, root: Path) -> ModuleType:
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise UserError(f"reward {target!r}: no such file {path}")
        return _load_file(f"k3post_user_reward_{path.stem}", path.resolve(), target)
    local = root.joinpath(*module_name.split(".")).with_suffix(".py")
    if local.is_file():
        loaded = sys.modules.get(module_name)
        loaded_file = getattr(loaded, "__file__", None)
        if loaded_file and Path(loaded_file).resolve() == local.resolve():
            return loaded  # already imported from this very file: do not run it twice
        return _load_file(module_name, local.resolve(), target)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        # Only "the module itself is missing" is the user's naming mistake; a missing
        # dependency *inside* the module is reported as an import failure below.
        if error.name is not None and (module_name == error.name or module_name.startswith(error.name + ".")):
            hint = did_you_mean(module_name, reward_modules(root), shown=f"{{}}:{target.partition(':')[2]}")
            raise UserError(
                f"reward {target!r}: no module {module_name!r}{hint} (looked for {local} and on the import path)"
            ) from error
        raise UserError(f"reward {target!r}: importing {module_name!r} failed: {error}") from error
    except Exception as error:
        what = f"{type(error).__name__}: {error}"
        raise UserError(f"reward {target!r}: importing {module_name!r} failed: {what}") from error


def reward_modules(root: Path) -> list[str]:
    """The reward modules a target can name without a path: `rewards.<stem>` for each file of
    `<root>/rewards/` and of the shipped `rewards` package (for 'did you mean')."""
    folders = [root / "rewards"]
    shipped = importlib.util.find_spec("rewards")
    if shipped is not None and shipped.submodule_search_locations:
        folders += [Path(p) for p in shipped.submodule_search_locations]
    stems = {f.stem for folder in folders if folder.is_dir() for f in folder.glob("*.py") if not f.stem.startswith("_")}
    return sorted(f"rewards.{stem}" for stem in stems)


def load_reward(target: str, root: str | Path | None = None) -> Callable[..., Any]:
    """The callable named by `target` ("module:function"); UserError naming `target` otherwise."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr or ":" in attr:
        raise UserError(f"reward {target!r}: expected '<module>:<function>', e.g. 'rewards.math:correctness'")
    module = _import(module_name, target, Path.cwd() if root is None else Path(root))
    if not hasattr(module, attr):
        available = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        hint = did_you_mean(attr, available, shown=f"{module_name}:{{}}")
        raise UserError(f"reward {target!r}: module {module_name!r} has no attribute {attr!r}{hint} "
                        f"(callables: {available})")
    fn = getattr(module, attr)
    if not callable(fn):
        raise UserError(f"reward {target!r}: {attr!r} is a {type(fn).__name__}, not a function")
    return fn


def make_reward_spec(
    target: str,
    weight: float = 1.0,
    name: str | None = None,
    kwargs: Mapping[str, Any] | None = None,
    root: str | Path | None = None,
) -> RewardSpec:
    """Load `target` and wrap it as a RewardSpec; the metric name defaults to the function name."""
    fn = load_reward(target, root=root)
    return RewardSpec(name=name or target.rpartition(":")[2], fn=fn, weight=float(weight), kwargs=dict(kwargs or {}))
