"""The metadata of a README.md that EVON's card joins: read as the user wrote it, merged key by key.

huggingface_hub's ``ModelCardData`` rebuilds the metadata from the fields it knows and drops what it
finds invalid (a ``model-index`` result without a ``dataset``), so a card updated through it loses
the user's own metadata. Here the README's YAML mapping is read as it stands, EVON's tags are added,
``library_name`` and ``base_model`` are filled in only where missing, and every other key is written
back as read. A UTF-8 byte-order mark before the opening ``---`` (Windows editors write one) does
not hide the block. YAML comments are not kept: no YAML reader returns them.
"""

from __future__ import annotations

from typing import Any

import yaml
from huggingface_hub import ModelCardData
from huggingface_hub.repocard import REGEX_YAML_BLOCK

__all__ = ["CardMetadataError", "merged_metadata", "metadata_block", "split_card"]


class CardMetadataError(ValueError):
    """A README's metadata that no merge can keep as written; the README is then left as it is."""


def split_card(content: str) -> tuple[dict[str, Any], str]:
    """``(metadata, body)`` of a README: its opening ``---`` block as a mapping ({} where there is
    none) and the text after it, found as the Hub finds them (``REGEX_YAML_BLOCK``)."""
    content = content.removeprefix("\ufeff")
    match = REGEX_YAML_BLOCK.search(content)
    if match is None:
        return {}, content
    try:
        data = yaml.safe_load(match.group(2))
    except (yaml.YAMLError, RecursionError) as err:  # a block nested past Python's recursion limit
        raise CardMetadataError(f"block does not parse ({(str(err).splitlines() or [''])[0]})") from err
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise CardMetadataError(f"block does not parse as a mapping (it is a {type(data).__name__})")
    return data, content[match.end() :]


def merged_metadata(data: dict[str, Any], fresh: ModelCardData) -> dict[str, Any]:
    """``data`` with ``fresh``'s tags added after its own, and ``fresh``'s ``library_name`` and
    ``base_model`` where ``data`` has none; every other key as it is."""
    tags = data.get("tags")
    if tags is None:
        tags = []
    elif isinstance(tags, str):
        tags = [tags]
    elif not isinstance(tags, list):
        raise CardMetadataError(f"has tags that are neither a list nor a string ({tags!r})")
    merged = {**data, "tags": tags + [t for t in fresh.tags or [] if t not in tags]}
    for key in ("library_name", "base_model"):
        if getattr(fresh, key, None) and not merged.get(key):
            merged[key] = getattr(fresh, key)
    return merged


def metadata_block(data: dict[str, Any]) -> str:
    """``data`` as the YAML between a card's ``---`` lines, keys in their order."""
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True).rstrip("\n")
