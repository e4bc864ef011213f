"""Result files written whole or not at all: each is written to `<path>.tmp`, then renamed over `path` (a rename is
atomic on POSIX file systems), so a run killed mid-write leaves the previous file, never half of a new one."""

from __future__ import annotations

import json
import os
from typing import Any


def write_text(path: str, text: str) -> None:
  with open(path + ".tmp", "w") as f:
    f.write(text)
  os.replace(path + ".tmp", path)


def write_json(path: str, obj: Any) -> None:
  write_text(path, json.dumps(obj, indent=2))


def write_json_on_process_0(path: str, obj: Any) -> None:
  """`write_json` by the first process only: every process of a run holds the same result."""
  import jax  # noqa: PLC0415  (only here: the rest of this module is plain file handling)
  if jax.process_index() == 0:
    write_json(path, obj)


def write_arrays(path: str, **arrays) -> None:
  """Numeric arrays as one .npz (plain .npy members: read back with allow_pickle=False)."""
  import numpy as np  # noqa: PLC0415

  with open(path + ".tmp", "wb") as f:
    np.savez(f, **arrays)
  os.replace(path + ".tmp", path)
