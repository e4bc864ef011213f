"""Fault injection: SIGTERM and SIGKILL of real training runs, then a bit-exact comparison with an uninterrupted run.

Runs experiments/soak.py (the code behind `make soak`) with two kills. It lives in its own file so that
`pytest -n 2 --dist loadfile` runs it beside the other reliability tests: it spends most of its time starting
subprocesses.
"""

import os

import pytest

from experiments import soak


def test_sigterm_and_sigkill_at_random_moments_resume_bit_exact(tmp_path):
  """A SIGTERM (must exit 0 with a checkpoint at its last logged step) then a SIGKILL; the resumed run's per-step
  losses equal an uninterrupted run's exactly. Runs and kills happen in subprocesses of experiments/train_lm.py."""
  home, tmp = tmp_path / "home", tmp_path / "tmp"
  home.mkdir()
  tmp.mkdir()
  kills = [soak.Kill("SIGTERM", after_step=2, delay=0.0), soak.Kill("SIGKILL", after_step=2, delay=0.15)]
  with pytest.MonkeyPatch.context() as patch:  # children write HOME / TMPDIR files here, not in the real home
    patch.setenv("HOME", str(home))
    patch.setenv("TMPDIR", str(tmp))
    summary = soak.soak(str(tmp_path / "soak"), kills, steps=10, every_steps=2, log=lambda _: None)
  assert summary["problems"] == []
  assert summary["kills_survived"] == 2 and summary["steps_compared"] == 10
  # Files only inside the workdir: the children's cwd (the soak folder) holds nothing else, TMPDIR stays empty,
  # and HOME gets only matplotlib's font cache (third-party; MPLCONFIGDIR moves it).
  assert sorted(os.listdir(tmp_path / "soak")) == ["corpus.jsonl", "interrupted", "jax_cache", "reference",
                                                  "soak_config.py"]
  assert not os.listdir(tmp)
  written = {os.path.relpath(os.path.join(d, f), home) for d, _, files in os.walk(home) for f in files}
  assert all(path.startswith(".cache/matplotlib/") for path in written), written
