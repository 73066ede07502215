"""Rotary position embedding, RoPE (Su et al., arXiv:2104.09864), and its context extensions.

Each 2-D slice (x[2i], x[2i+1]) of a query or key at position m is rotated by m * theta_i,
theta_i = base^(-e_i), so <R(m) q, R(n) k> depends on m - n only. d is the geometry's
rotary_dims: the leading channels of each head that rotate (the whole head unless the mixer
decouples them); any channels after them pass unchanged. The exponents e_i (i < d / 2) are the
geometry's `rotary_frequencies`, chosen by the mixer (`Mixer.position_geometry`):
  rope    e_i = 2i / d: RoPE's, for every mixer but retention.
  retnet  e_i = i / (d/2 - 1), torch.linspace(0, 1, d / 2): RetNet's (microsoft/torchscale@
          4d1e0e82e5adf86dd424f1463192635b73fc8efc, torchscale/architecture/retnet.py,
          RetNetRelPos.__init__: angle = 1 / 10000 ** linspace(0, 1, head_dim // 2), each
          repeated twice), the lowest frequency 1 / base instead of base^(-(d - 2) / d); the
          retention mixer's default (model.retention.rotary_frequencies).
Both schedules pair adjacent channels, as torchscale's `rotate_every_two` does
(torchscale/component/multiscale_retention.py, `theta_shift` = x cos + rotate_every_two(x) sin
with angle[2i] = angle[2i + 1] = theta_i), and the original RoPE: (x[2i], x[2i+1]) ->
(x[2i] cos - x[2i+1] sin, x[2i+1] cos + x[2i] sin), the same rotation, sign and pairing as
theirs. (HF Llama's `rotate_half` pairs x[i] with x[i + d/2] instead; with the same theta_i per
pair the two differ by one fixed permutation P of each head's channels, and since
<Pa, Pb> = <a, b> a model with q / k projections W is exactly the other with P W: the same
function class, the same logits after permuting the projections' output channels.)

Scalings (model.rope.scaling), with s = scaling_factor and L = original_length (the training
length); each follows the code its authors published, as HF transformers' modeling_rope_utils:
  pi           position interpolation (Chen et al., arXiv:2306.15595): theta_i / s.
  static_ntk   NTK-aware, static (bloc97): base -> base * s^(d / (d - 2)), the base that divides
               the lowest frequency by s (with RetNet's exponents: base * s).
  dynamic_ntk  HF's dynamic NTK: base -> base * (s * n / L - (s - 1))^(d / (d - 2)) with
               n = max(L, current length), the current length being the largest position + 1
               in the call; no change up to L (RetNet's exponents: power 1 instead of d / (d - 2)).
  yarn         YaRN (Peng et al., arXiv:2309.00071; jquesnelle/yarn = HF
               `_compute_yarn_parameters`): correction dims d_r = d ln(L / (2 pi r)) / (2 ln base)
               for r = beta = 32 and r = alpha = 1 (the pair index whose wavelength is L / r;
               with RetNet's exponents (d/2 - 1) ln(L / (2 pi r)) / ln base), rounded out to
               [floor(d_32), ceil(d_1)] and clamped to [0, d - 1]; ramp = clip((i - low) /
               (high - low), 0, 1) over the pair index i (+0.001 on high when the ends meet);
               theta_i' = theta_i / s * ramp + theta_i * (1 - ramp). The attention temperature
               m = 0.1 ln s + 1 multiplies cos and sin in the reference code, so the logits
               carry m^2: here `logit_scale()`, taken by softmax attention only (linear
               attention and retention have no softmax).
  llama3       Llama 3.1's (meta-llama/llama-models, HF `_compute_llama3_parameters`): with the
               wavelength w_i = 2 pi / theta_i and lo = L / low_freq_factor, hi = L /
               high_freq_factor: theta_i / s where w_i > lo, theta_i where w_i < hi, and between
               them (1 - a) theta_i / s + a theta_i with a = (L / w_i - low_freq_factor) /
               (high_freq_factor - low_freq_factor).
`rotate` itself is a pure rotation under every scaling.
"""

import math

import jax.numpy as jnp

from research.model import registry
from research.model.positions import base

SCALINGS = ("none", "pi", "static_ntk", "dynamic_ntk", "yarn", "llama3")
# The exponent schedules of theta_i = base^(-e_i) (a geometry's rotary_frequencies).
FREQUENCIES = ("rope", "retnet")
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0


def exponents(rotary_dims, frequencies="rope"):
  """e_i, i < rotary_dims / 2, float32: theta_i = base^(-e_i)."""
  if frequencies == "retnet":
    return jnp.linspace(0.0, 1.0, rotary_dims // 2, dtype=jnp.float32)
  return jnp.arange(0, rotary_dims, 2, dtype=jnp.float32) / rotary_dims


def ntk_power(rotary_dims, frequencies="rope"):
  """1 / e_max: the power of s in an NTK base change, so that the lowest frequency is divided
  by s: d / (d - 2) for RoPE (HF's), 1 for RetNet's schedule (e_max = 1)."""
  return rotary_dims / (rotary_dims - 2) if frequencies == "rope" else 1.0


def yarn_correction_range(head_dim, base_frequency, original_length, frequencies="rope"):
  """(low, high) pair indices of YaRN's ramp, as its reference code rounds and clamps them."""

  # 2 / (e_{i+1} - e_i): d for RoPE's 2i / d, 2 (d/2 - 1) for RetNet's i / (d/2 - 1).
  steps = head_dim if frequencies == "rope" else 2 * (head_dim // 2 - 1)

  def correction_dim(rotations):
    return (steps * math.log(original_length / (rotations * 2 * math.pi))
            / (2 * math.log(base_frequency)))

  low = max(math.floor(correction_dim(YARN_BETA_FAST)), 0)
  high = min(math.ceil(correction_dim(YARN_BETA_SLOW)), head_dim - 1)
  return low, high


def scaling_for_length(scaling, eval_length, train_length):
  """The scaling settings to evaluate a model trained at `train_length` at `eval_length`:
  s = max(1, eval / train) for the static scalings; dynamic NTK keeps s = 1 and adapts to the
  current length itself (with s = 1 it scales the base by n / L)."""
  factor = 1.0 if scaling == "dynamic_ntk" else max(1.0, eval_length / train_length)
  return {"scaling": scaling, "scaling_factor": factor, "original_length": train_length}


class RoPE(base.PositionScheme):
  hyperparameters = {"base": 10000.0, "scaling": "none", "scaling_factor": 1.0,
                     "original_length": 128,
                     # llama3 scaling only: the wavelength band L / high .. L / low that blends
                     "low_freq_factor": 1.0, "high_freq_factor": 4.0}
  test_settings = {"original_length": 16}
  rotary = True

  def __init__(self, settings, geometry, *, rngs):
    del rngs
    self.base_frequency = float(settings.base)
    self.scaling = settings.scaling
    self.factor = float(settings.scaling_factor)
    self.original_length = int(settings.original_length)
    self.low_freq_factor = float(settings.get("low_freq_factor", 1.0))
    self.high_freq_factor = float(settings.get("high_freq_factor", 4.0))
    self.rotary_dims = geometry.rotary_dims
    self.frequencies = geometry.rotary_frequencies

  @classmethod
  def validate(cls, settings, geometry):
    if geometry.rotary_dims % 2 or not 0 < geometry.rotary_dims <= geometry.head_dim:
      raise ValueError(f"rotary positions need an even number of rotary dims in (0, head_dim = "
                       f"{geometry.head_dim}], got {geometry.rotary_dims} (with the usual "
                       f"geometry: choose num_heads so that d_model / num_heads is even)")
    if geometry.rotary_frequencies not in FREQUENCIES:
      raise ValueError(f"unknown rotary frequencies {geometry.rotary_frequencies!r}; valid: "
                       f"{', '.join(FREQUENCIES)}")
    if geometry.rotary_frequencies == "retnet" and geometry.rotary_dims < 4:
      raise ValueError(f"RetNet's rotary frequencies (linspace(0, 1, rotary_dims / 2) exponents) "
                       f"need rotary_dims >= 4, got {geometry.rotary_dims}: use wider heads, or "
                       f"RoPE's frequencies (model.retention.rotary_frequencies='rope')")
    if settings.base <= 1:
      raise ValueError(f"the rotary base must be > 1, got {settings.base} (10000 is usual)")
    if settings.scaling not in SCALINGS:
      raise ValueError(f"unknown rotary scaling {settings.scaling!r} (the scheme's scaling field, "
                       f"e.g. model.rope.scaling){registry.did_you_mean(settings.scaling, SCALINGS)}"
                       f"; valid: {', '.join(SCALINGS)}")
    if settings.scaling_factor < 1:
      raise ValueError(f"the rotary scaling_factor must be >= 1, got {settings.scaling_factor}")
    if settings.original_length < 1:
      raise ValueError(f"the rotary original_length must be >= 1, got {settings.original_length}")
    if settings.scaling == "llama3" and not 0 < settings.low_freq_factor < settings.high_freq_factor:
      raise ValueError(f"llama3 scaling needs 0 < low_freq_factor < high_freq_factor, got "
                       f"{settings.low_freq_factor} and {settings.high_freq_factor} (Llama 3.1: "
                       "1 and 4)")

  def inverse_frequencies(self, positions_BxL=None):
    """theta_i for i < rotary_dims / 2, after scaling, float32 [rotary_dims / 2]."""
    d, s, base_frequency = self.rotary_dims, self.factor, self.base_frequency
    power = ntk_power(d, self.frequencies)
    if self.scaling == "static_ntk":
      base_frequency = base_frequency * s ** power
    if self.scaling == "dynamic_ntk" and positions_BxL is not None:
      length = jnp.maximum(positions_BxL.max() + 1, self.original_length).astype(jnp.float32)
      base_frequency = base_frequency * (s * length / self.original_length - (s - 1)) ** power
    theta = base_frequency ** -exponents(d, self.frequencies)
    if self.scaling == "pi":
      theta = theta / s
    if self.scaling == "yarn":
      low, high = yarn_correction_range(d, self.base_frequency, self.original_length,
                                        self.frequencies)
      high = high + 0.001 if low == high else high
      ramp = jnp.clip((jnp.arange(d // 2, dtype=jnp.float32) - low) / (high - low), 0.0, 1.0)
      theta = theta / s * ramp + theta * (1 - ramp)
    if self.scaling == "llama3":
      theta = self._llama3(theta)
    return theta

  def _llama3(self, theta):
    s, length = self.factor, self.original_length
    low, high = self.low_freq_factor, self.high_freq_factor
    wavelength = 2 * math.pi / theta
    blend = (length / wavelength - low) / (high - low)
    blended = (1 - blend) * theta / s + blend * theta
    scaled = jnp.where(wavelength > length / low, theta / s, theta)
    return jnp.where((wavelength >= length / high) & (wavelength <= length / low), blended,
                     scaled)

  def rotate(self, x_BxLxNxH, positions_BxL):
    """x with each pair (x[2i], x[2i+1]) of its rotary dims rotated by position * theta_i; a
    pure rotation."""
    if self.rotary_dims < x_BxLxNxH.shape[-1]:
      rotated = self.rotate(x_BxLxNxH[..., :self.rotary_dims], positions_BxL)
      return jnp.concatenate([rotated, x_BxLxNxH[..., self.rotary_dims:]], axis=-1)
    theta = self.inverse_frequencies(positions_BxL)
    angle = positions_BxL.astype(jnp.float32)[..., None] * theta  # [B, L, H/2]
    cos, sin = jnp.cos(angle)[:, :, None, :], jnp.sin(angle)[:, :, None, :]
    x = x_BxLxNxH.astype(jnp.float32)
    even, odd = x[..., 0::2], x[..., 1::2]
    rotated = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
    return rotated.reshape(x.shape).astype(x_BxLxNxH.dtype)

  def queries(self, q_BxLxNxH, positions_BxL):
    return self.rotate(q_BxLxNxH, positions_BxL)

  def keys(self, k_BxLxKxH, positions_BxL):
    return self.rotate(k_BxLxKxH, positions_BxL)

  def logit_scale(self):
    """YaRN's m^2 = (0.1 ln s + 1)^2 on the softmax logits (m on cos and sin of q and k)."""
    if self.scaling == "yarn" and self.factor > 1:
      return (0.1 * math.log(self.factor) + 1.0) ** 2
    return 1.0
