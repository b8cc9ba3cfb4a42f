"""Resolve user-given names (leaf modules, split points) against the model, with suggestions.

Names are the fully qualified names of ``module.named_modules()`` (``"blocks.3"``), class names
(``"Block"``) where a class is meant, or graph node names (``"add_3"``) for split points. An
unknown name is a typo far more often than not, so the error lists the closest known names.
"""

from __future__ import annotations

import difflib
from typing import Iterable, Sequence

from torch import nn

from lightning_gsched.partition.errors import UnknownNameError


def close_matches(name: str, known: Iterable[str], limit: int = 5) -> list[str]:
    """Closest known names to ``name``: fuzzy matches first, then names sharing its last atom."""
    known = sorted(set(known))
    matches = difflib.get_close_matches(name, known, n=limit, cutoff=0.5)
    tail = name.rsplit(".", 1)[-1]
    for candidate in known:
        if len(matches) >= limit:
            break
        if candidate not in matches and candidate.rsplit(".", 1)[-1] == tail:
            matches.append(candidate)
    return matches


def unknown_name_error(what: str, name: str, known: Iterable[str], fix: str) -> UnknownNameError:
    suggestions = close_matches(name, known)
    hint = (
        f" Close matches: {', '.join(repr(s) for s in suggestions)}."
        if suggestions
        else " No close match; list names with [n for n, _ in module.named_modules()]."
    )
    return UnknownNameError(f"{what} {name!r} is not in the model.{hint} {fix}")


def resolve_leaf_modules(
    module: nn.Module, leaf_modules: Sequence[type | str]
) -> tuple[tuple[type, ...], frozenset[str]]:
    """Split ``leaf_modules`` into module classes and module FQNs (class names become classes)."""
    by_name = dict(module.named_modules(remove_duplicate=False))
    by_class_name: dict[str, set[type]] = {}
    for m in by_name.values():
        cls = type(m)
        for key in (cls.__name__, cls.__qualname__, f"{cls.__module__}.{cls.__qualname__}"):
            by_class_name.setdefault(key, set()).add(cls)
    classes: list[type] = []
    names: set[str] = set()
    for item in leaf_modules:
        if isinstance(item, type):
            if not issubclass(item, nn.Module):
                raise UnknownNameError(
                    f"leaf_modules entry {item!r} is not an nn.Module subclass; pass module "
                    "classes (e.g. leaf_modules=(Block,)) or module names (e.g. 'blocks.0')."
                )
            classes.append(item)
        elif isinstance(item, str):
            if item in by_name and item != "":
                names.add(item)
            elif item in by_class_name:
                classes.extend(sorted(by_class_name[item], key=lambda c: c.__qualname__))
            else:
                raise unknown_name_error(
                    "leaf_modules entry",
                    item,
                    [n for n in by_name if n] + list(by_class_name),
                    "Name a submodule by its fully qualified name or a module class by name.",
                )
        else:
            raise UnknownNameError(
                f"leaf_modules entry {item!r} is neither a module class nor a module name."
            )
    return tuple(classes), frozenset(names)
