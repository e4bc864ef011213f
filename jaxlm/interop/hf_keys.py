"""Reading config.json's keys with one-line errors that name the file and the key (every family's reader uses it)."""

from __future__ import annotations

from typing import Any, Callable


def readers(hf: dict, where: str) -> tuple[Callable[..., Any], Callable[[bool, str, str], None]]:
  """(get, need) for config.json `hf` read from `where`: get(key[, default]) is a missing key's one-line error
  without a default; need(ok, key, supported) refuses the key's value unless ok, saying what is supported."""

  def get(key: str, default: Any = KeyError) -> Any:
    if key not in hf and default is KeyError:
      raise ValueError(f"{where}: missing key {key!r}")
    return hf.get(key, default)

  def need(ok: bool, key: str, supported: str) -> None:
    if not ok:
      raise ValueError(f"{where}: {key}={hf.get(key)!r} is not supported (jaxlm supports {supported})")

  return get, need
