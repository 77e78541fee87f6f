"""Input arrays for `opfuse run` and `opfuse bench`: an .npz (one array per model input, by name)
or, for a model with one input, an .npy; matched to the model's inputs with errors that say how."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from client.commands.common import CLIError, require_file

__all__ = ["bind_inputs", "read_inputs"]


def read_inputs(path: Path) -> dict[str, np.ndarray] | np.ndarray:
    """The arrays in an .npz by name, or the one array of an .npy (matched to an input later)."""
    require_file(path, "inputs file")
    try:
        loaded = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise CLIError(
            f"cannot read {path} as input arrays ({exc}); save them with np.savez(path, name=array, ...) "
            "or, for a model with one input, np.save(path, array)",
            2,
        ) from None
    if isinstance(loaded, np.ndarray):
        return loaded
    with loaded:
        try:
            return {name: loaded[name] for name in loaded.files}
        except ValueError as exc:  # an object array needs pickle: refused
            raise CLIError(f"cannot read {path}: {exc}", 2) from None


def _described(specs: Sequence[Mapping[str, Any]]) -> str:
    return ", ".join(f"{s.get('name')} [{', '.join(str(d) for d in s.get('shape') or [])}]" for s in specs)


def bind_inputs(
    loaded: Mapping[str, np.ndarray] | np.ndarray, specs: Sequence[Mapping[str, Any]], path: Path
) -> dict[str, np.ndarray]:
    """`loaded` as {input name: array}: an .npy goes to the one input; an .npz must name every input."""
    names = [str(s.get("name")) for s in specs]
    if isinstance(loaded, np.ndarray):
        if len(names) != 1:
            raise CLIError(
                f"{path} holds one array but the model has {len(names)} inputs ({_described(specs)}); "
                "save them by name with np.savez(path, name=array, ...)",
                2,
            )
        return {names[0]: loaded}
    missing = [n for n in names if n not in loaded]
    unknown = [n for n in loaded if n not in names]
    if missing or unknown:
        parts = []
        if missing:
            parts.append(f"no array for {', '.join(missing)}")
        if unknown:
            parts.append(f"no input named {', '.join(unknown)}")
        raise CLIError(f"{path}: {'; '.join(parts)}; the model's inputs are: {_described(specs)}", 2)
    return dict(loaded)
