"""Reading YAML the user wrote: ``yaml.safe_load`` with a bound on what aliases expand to.

Every command reads its YAML through :func:`load_yaml` (the merge config through
:func:`mergekit_ext.config.parse_config`, ``diagnose --heldout`` mappings, the config copy
``publish`` redacts), before any model is looked at.
"""

from __future__ import annotations

import logging
from typing import Any

import yaml

from mergekit_ext.errors import ConfigError

LOG = logging.getLogger(__name__)

# A YAML alias shares its anchor's value; code that walks the parsed config (pydantic,
# the card's path shortening) visits it once per alias, so nested aliases ("billion
# laughs": 929 bytes, 10^9 values) hang whatever walks them. A real config, anchors and
# all, is a few thousand values.
MAX_YAML_VALUES = 100_000


class _CountingLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that records the anchors its aliases name (for the error)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.alias_names: list[str] = []
        self.duplicate_keys: list[tuple[str, int, int]] = []  # (key, first line, line)

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        """A key given twice: YAML keeps the last silently; say so, naming key and line."""
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.value == "<<":
                    continue
                line = key_node.start_mark.line + 1
                if key_node.value in seen:
                    self.duplicate_keys.append((key_node.value, seen[key_node.value], line))
                seen[key_node.value] = line
        return super().construct_mapping(node, deep=deep)

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            self.alias_names.append(self.peek_event().anchor)
        return super().compose_node(parent, index)


def _expanded_size(root: yaml.Node, limit: int) -> int:
    """How many values ``root`` holds with every alias expanded, stopping past ``limit``."""
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in active:  # an alias to an enclosing anchor: an infinite value
            return limit + 1
        active.add(key)
        total = 1
        if isinstance(node, yaml.SequenceNode):
            children: list[yaml.Node] = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            children = [x for pair in node.value for x in pair]
        else:
            children = []
        for child in children:
            total += size(child)
            if total > limit:
                break
        active.discard(key)
        sizes[key] = total
        return total

    return size(root)


def load_yaml(text: str, where: str) -> Any:
    """``yaml.safe_load`` that refuses aliases expanding beyond :data:`MAX_YAML_VALUES`.

    Every command reads its config through here (:func:`mergekit_ext.config.parse_config`),
    before any model is looked at.
    """
    try:
        loader = _CountingLoader(text)  # checks the characters: a binary file fails here
    except yaml.YAMLError as e:
        raise ConfigError(
            f"{where}: not a YAML text file ({e}); give the merge config, a .yml file".replace(
                "\n", " "
            )
        ) from None
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if loader.alias_names and _expanded_size(node, MAX_YAML_VALUES) > MAX_YAML_VALUES:
            names = ", ".join(f"*{n}" for n in dict.fromkeys(loader.alias_names))
            raise ConfigError(
                f"{where}: the YAML's aliases ({names}) expand to more than "
                f"{MAX_YAML_VALUES:,} values (nested or recursive anchors); write the values "
                "out, or use fewer levels of aliases"
            )
        value = loader.construct_document(node)
        for key, first, line in loader.duplicate_keys:
            LOG.warning(
                "%s: the key '%s' is given twice (lines %d and %d); the one on line %d is "
                "used: remove the other",
                where,
                key,
                first,
                line,
                line,
            )
        return value
    except yaml.composer.ComposerError as e:
        if "expected a single document" not in str(e):
            raise ConfigError(f"{where}: invalid YAML: {e}".replace("\n", " ")) from e
        line = e.problem_mark.line + 1 if e.problem_mark is not None else None
        raise ConfigError(
            f"{where} holds several YAML documents (the second starts at line {line}): a "
            "mergekit-multi file, one merge per document. mergekit-ext runs one merge per "
            "file: save each document as its own file and run `mergekit-ext run PART.yml "
            "OUT_DIR` for each, in order (a later document names an earlier one's output "
            "folder as its model), or run the file with `mergekit-multi`"
        ) from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: invalid YAML: {e}".replace("\n", " ")) from e
    finally:
        loader.dispose()
