"""Rotary position embeddings (Llama and the families after it, ModernBERT): the per-dimension frequencies with
every scaling a checkpoint may ask for (linear, Llama 3.1's, YaRN, dynamic NTK), the cos/sin tables every layer
shares, and the rotation itself (HF's rotate_half convention).

Dimension letters: B batch, T positions, H heads, K head dim, k = K / 2 rotary pairs.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np



class Rotary(NamedTuple):
  """cos and sin of every rotary angle, [B, T, K/2] in f32: computed once per forward pass and shared by every layer
  (as HF does), so XLA does not fuse their evaluation into each layer's rotation, per head and element."""
  cos_BTk: jax.Array
  sin_BTk: jax.Array


def rotary_frequencies(head_dim: int, theta: float, scaling: str = "", factor: float = 1.0,
                       low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
                       original_max_positions: int = 8192, beta_fast: float = 32.0,
                       beta_slow: float = 1.0) -> np.ndarray:
  """The K/2 rotary frequencies (f32), stretched for longer contexts as `scaling` says: `linear` divides them all
  by `factor`; `llama3` (Llama 3.1) divides those whose wavelength exceeds original_max_positions /
  low_freq_factor, keeps those below original_max_positions / high_freq_factor, and blends linearly between; `yarn`
  keeps the dimensions that turn more than beta_fast times over original_max_positions, divides those that turn
  fewer than beta_slow times, and ramps linearly between (HF's truncated correction range). `dynamic` depends on
  the positions (`dynamic_frequencies`): here it gives the unscaled ones."""
  half = head_dim // 2
  inv_freq = 1.0 / theta ** (np.arange(0, 2 * half, 2, dtype=np.float64) / (2 * half))
  if scaling == "linear":
    inv_freq = inv_freq / factor
  elif scaling == "llama3":
    wavelength = 2 * np.pi / inv_freq
    blend = (original_max_positions / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - blend) * inv_freq / factor + blend * inv_freq
    low = wavelength > original_max_positions / low_freq_factor
    high = wavelength < original_max_positions / high_freq_factor
    inv_freq = np.where(low, inv_freq / factor, np.where(high, inv_freq, blended))
  elif scaling == "yarn":
    def dimension(rotations):  # the dimension that turns `rotations` times over the original context
      return head_dim * math.log(original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = max(math.floor(dimension(beta_fast)), 0), min(math.ceil(dimension(beta_slow)), head_dim - 1)
    ramp = np.clip((np.arange(half) - low) / ((high - low) or 0.001), 0, 1)
    inv_freq = inv_freq / factor * ramp + inv_freq * (1 - ramp)
  return inv_freq.astype(np.float32)


def yarn_attention_factor(factor: float, attention_factor: float = 0.0) -> float:
  """YaRN's scale of cos and sin: the given one, else 0.1 ln(factor) + 1 (1 when factor <= 1)."""
  return attention_factor or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)


def dynamic_frequencies(positions_BT: jax.Array, head_dim: int, theta: float, factor: float,
                        max_positions: int) -> jax.Array:
  """Dynamic NTK scaling (HF's `dynamic`): past max_positions, the base grows with the longest position seen,
  theta * (factor * n / max_positions - (factor - 1)) ** (K / (K - 2)) for n = max(positions) + 1; below it the
  frequencies are the unscaled ones."""
  n = jnp.maximum(jnp.max(positions_BT) + 1, max_positions).astype(jnp.float32)
  base = theta * (factor * n / max_positions - (factor - 1)) ** (head_dim / (head_dim - 2))
  return 1.0 / base ** (jnp.arange(0, head_dim - 1, 2, dtype=jnp.float32) / head_dim)


def rotary_tables(positions_BT: jax.Array, head_dim: int, theta: float, inv_freq=None,
                  scale: float = 1.0) -> Rotary:
  """The Rotary tables of `positions` (each row its own, e.g. restarting at every packed document's start);
  `inv_freq` (`rotary_frequencies`) defaults to the unscaled frequencies of `theta`; `scale` multiplies cos and sin
  (YaRN)."""
  if inv_freq is None:
    inv_freq = rotary_frequencies(head_dim, theta)
  angles_BTk = positions_BT.astype(jnp.float32)[:, :, None] * jnp.asarray(inv_freq)[None, None, :]
  if scale != 1.0:
    return Rotary(jnp.cos(angles_BTk) * scale, jnp.sin(angles_BTk) * scale)
  return Rotary(jnp.cos(angles_BTk), jnp.sin(angles_BTk))


def apply_rope(x_BTHK: jax.Array, rotary: Rotary) -> jax.Array:
  """Rotary position embedding, HF's rotate_half convention: dims i and i + K/2 form one rotated pair."""
  half = x_BTHK.shape[-1] // 2
  cos, sin = rotary.cos_BTk[:, :, None, :], rotary.sin_BTk[:, :, None, :]  # [B, T, 1, K/2]
  x = x_BTHK.astype(jnp.float32)
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_BTHK.dtype)
