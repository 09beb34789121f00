"""YAML as a recipe needs it: safe, bounded, and strict about duplicate keys.

Three things plain `yaml.safe_load` allows that a recipe must not:

- **Duplicate keys.** `optim: {lr: 1e-4, lr: 1e-5}` silently keeps the last value; here it is
  an error naming both lines.
- **Alias bombs.** Anchors and aliases share one node, so `b: [*a, *a, ...]` nested ten deep is a
  small file whose *expanded* value has billions of items. PyYAML builds it cheaply (the lists
  are shared), but anything that walks it (validation, printing an error message, `json.dumps`)
  expands it. We count aliases (`MAX_ALIASES`) and the expanded size of the document
  (`MAX_NODES`, computed in linear time with a memo over shared nodes) before constructing
  Python objects.
- **Non-UTF-8 / binary files**, which config/text_files.py turns into located errors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, SequenceNode

from k3post.config.errors import RecipeError, located, shorten
from k3post.config.text_files import read_text

MAX_ALIASES = 200  # a recipe uses a handful; YAML bombs use thousands
MAX_NODES = 200_000  # scalars + containers once aliases are expanded (a large recipe has ~1,000)


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys and counts aliases while composing."""

    def __init__(self, stream) -> None:
        super().__init__(stream)
        self.aliases = 0

    def compose_node(self, parent, index):  # noqa: ANN001 - PyYAML's signature
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > MAX_ALIASES:
                mark = self.peek_event().start_mark
                raise yaml.YAMLError(f"line {mark.line + 1}: more than {MAX_ALIASES} aliases (*name); "
                                     "a recipe needs few, and many nested ones can expand to gigabytes")
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):  # noqa: ANN001
        if isinstance(node, MappingNode):
            _refuse_duplicate_keys(self, node)
        return super().construct_mapping(node, deep=deep)


def _refuse_duplicate_keys(loader: yaml.SafeLoader, node: MappingNode) -> None:
    """A key written twice in one mapping is an error. Checked before `<<` merges are flattened:
    overriding a merged key is what merges are for."""
    seen: dict[Any, str] = {}
    for key_node, _ in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
            continue  # PyYAML itself rejects unhashable keys, with a line
        key = loader.construct_object(key_node)
        mark = key_node.start_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}"
        if key in seen:
            raise yaml.YAMLError(f"{where}: duplicate key {shorten(key)} (first at {seen[key]}); "
                                 "YAML would silently keep the last one")
        seen[key] = where


def expanded_size(node: Node, memo: dict[int, int] | None = None) -> int:
    """How many nodes `node` stands for once every alias is expanded.

    A shared node (an anchor used by aliases) is counted once per use, but computed once: the
    memo keeps this linear in the file's size even when the answer is astronomically large.
    """
    memo = {} if memo is None else memo
    if id(node) in memo:
        return memo[id(node)]
    memo[id(node)] = 1  # a cycle (recursive alias) counts once; PyYAML's constructor rejects it anyway
    if isinstance(node, SequenceNode):
        size = 1 + sum(expanded_size(child, memo) for child in node.value)
    elif isinstance(node, MappingNode):
        size = 1 + sum(expanded_size(k, memo) + expanded_size(v, memo) for k, v in node.value)
    else:
        size = 1
    memo[id(node)] = size
    return size


def load_yaml_text(text: str, path: Path) -> Any:
    """Parse YAML text (one document) with the bounds above; errors are RecipeErrors naming `path`."""
    loader = _BoundedLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        size = expanded_size(node)
        if size > MAX_NODES:
            raise yaml.YAMLError(f"the document expands to {size:,} values once its aliases are expanded "
                                 f"(more than {MAX_NODES:,}); a recipe is far smaller - check the anchors (&) "
                                 "and aliases (*)")
        return loader.construct_document(node)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"line {mark.line + 1}: " if mark is not None else ""
        raise RecipeError(located(path, f"{where}not valid YAML: {err.problem or err}")) from None
    except yaml.YAMLError as err:
        raise RecipeError(located(path, str(err))) from None
    except RecursionError:
        raise RecipeError(located(path, "nested too deeply to be a recipe")) from None
    finally:
        loader.dispose()


def read_yaml_file(path: Path, what: str = "recipe") -> Any:
    """Read and parse one YAML file; any failure is a RecipeError naming the file."""
    return load_yaml_text(read_text(path, what), path)
