"""YAML read with bounds on what it can expand to: an alias bomb or a recursive alias is refused while the
document is still a node graph, before anything (the schema, the warm-start thread) walks it.

Why: PyYAML builds `&a [*b, *b, ...]` chains as shared objects, so loading a "billion laughs" document is
instant, but every walk over the result visits each shared object once per path to it: a nine-level bomb is
387 million visits. The merge command's warm-start thread walks the config for model paths, and the schema
walks it again; with the GIL held that took 4 to 34 s before the error. Here the node graph is measured
once, each distinct node once (its expanded size memoised), so the check costs the size of the file.

A document nested deeper than Python's recursion allows (PyYAML's composer recurses per level) is
refused the same way, as one line, instead of an internal RecursionError.
"""

from __future__ import annotations

from typing import Any

import yaml

MAX_EXPANDED_NODES = 100_000
"""The most nodes a config may expand to through its aliases. A large real config (a frankenmerge of 200
slices, an evolve run over 30 models) has a few thousand; walking 100,000 takes well under a second."""


class YamlLimitError(ValueError):
    """The document expands past MAX_EXPANDED_NODES, refers to itself, or nests too deeply."""


def expanded_size(root: yaml.Node, limit: int = MAX_EXPANDED_NODES) -> int:
    """Nodes in the document once every alias is replaced by a copy of what it names (YamlLimitError past
    `limit`, or on a node that contains itself). Iterative, so a deep document cannot exhaust the stack."""
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            on_path.discard(key)
            size = 1 + sum(sizes[id(child)] for child in _children(node))
            if size > limit:
                raise YamlLimitError(
                    f"expands to more than {limit:,} values through its aliases (`*name`); "
                    "a config that large is most likely an alias bomb"
                )
            sizes[key] = size
            continue
        if key in sizes:
            continue
        if key in on_path:
            raise YamlLimitError("an alias (`*name`) refers to a value that contains it (a recursive structure)")
        on_path.add(key)
        stack.append((node, True))
        stack.extend((child, False) for child in _children(node) if id(child) not in sizes)
    return sizes[id(root)]


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def load_documents(text: str, *, all_documents: bool) -> Any:
    """yaml.safe_load (or safe_load_all, as a list) of `text`, after the expansion check of each document.

    Raises yaml.YAMLError for malformed YAML (as PyYAML does) and YamlLimitError for the cases above."""
    loader = yaml.SafeLoader(text)
    try:
        if not all_documents:
            node = loader.get_single_node()
            if node is None:
                return None
            expanded_size(node)
            return loader.construct_document(node)
        documents = []
        while loader.check_node():
            node = loader.get_node()
            expanded_size(node)
            documents.append(loader.construct_document(node))
        return documents
    except RecursionError:
        raise YamlLimitError("is nested too deeply to read") from None
    finally:
        loader.dispose()
