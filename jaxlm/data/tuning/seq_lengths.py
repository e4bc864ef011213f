"""Sequence lengths derived from the data: with data.seq_len=0 a fine-tuning run takes the 99th percentile of its
tokenized training lengths, rounded up to a multiple of 8 and capped by the model's position table
(`choose_seq_len`). Whatever seq_len is, a run that cuts more than `TRUNCATION_WARNING_RATE` of its examples prints a
warning line saying how many and what to change (`truncation_warning`).
"""

from __future__ import annotations

import math

import numpy as np

SEQ_LEN_PERCENTILE = 99.0  # a chosen data.seq_len keeps this share of the examples whole
SEQ_LEN_MULTIPLE = 8  # a chosen data.seq_len is rounded up to a multiple of this (friendlier matmul shapes)
TRUNCATION_WARNING_RATE = 0.02  # more than this share of examples cut prints a warning


def choose_seq_len(lengths: np.ndarray, max_positions: int, at_least: int = 1) -> int:
  """The sequence length for tokenized `lengths`: their 99th percentile rounded up to a multiple of 8, at least
  `at_least`, at most `max_positions`."""
  if len(lengths) == 0:
    return min(max_positions, max(at_least, SEQ_LEN_MULTIPLE))
  high = int(math.ceil(float(np.percentile(np.asarray(lengths), SEQ_LEN_PERCENTILE))))
  rounded = -(-max(high, at_least, 1) // SEQ_LEN_MULTIPLE) * SEQ_LEN_MULTIPLE
  return int(min(max_positions, rounded))


def truncation_warning(num_cut: int, num_examples: int, seq_len: int, max_positions: int,
                       chosen: bool) -> str | None:
  """The warning line when more than TRUNCATION_WARNING_RATE of the examples are cut, else None."""
  if num_examples == 0 or num_cut / num_examples <= TRUNCATION_WARNING_RATE:
    return None
  if seq_len >= max_positions:
    advice = f"the model has no more positions ({max_positions}); shorten the texts or use a longer-context model"
  elif chosen:
    advice = f"set data.seq_len up to the model's {max_positions} positions"
  else:
    advice = f"raise data.seq_len (the model has {max_positions} positions) or set it to 0 to choose it from the data"
  return (f"warning: {num_cut / num_examples:.1%} of the examples ({num_cut} of {num_examples}) are longer than "
          f"data.seq_len={seq_len} tokens and are cut; {advice}")
