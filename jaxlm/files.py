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
