"""Time costs of a node's work, from the model's geometry and the node's hardware.

- Prefill is compute-bound: FLOPs of the tokens it computes (2 x active parameters each, plus
  attention over the context before them, `ModelGeometry.flops_per_token`) over the node's
  effective FLOP/s (GPUs x dense bf16 peak x MFU).
- A decode step is memory-bound at serving batch sizes: it reads every weight once and the KV
  of every running request once, at the node's HBM bandwidth times an achieved fraction; it
  also cannot beat its compute time, 2 x active parameters per token in the batch. A fixed
  per-step overhead covers scheduling and kernel launches.

With S the sum of the batch's context lengths and B its size, one step takes
`a(B) + b * S` seconds, and S grows by B each step, so k steps take a closed-form time; the
simulator fast-forwards whole stretches of steps with it instead of looping per token.
"""

from __future__ import annotations

import math

import attrs

from hicache.sim.geometry import ModelGeometry
from hicache.sim.hardware import GPU


@attrs.frozen(slots=True)
class NodeCosts:
    """Costs of one node of `gpus` GPUs serving `model` with tensor parallelism."""

    model: ModelGeometry
    gpu: GPU
    gpus: int = 1
    step_overhead: float = 0.005  # s per decode step: scheduler + launches (SGLang-class engines)

    @property
    def flops(self) -> float:
        return self.gpu.effective_flops * self.gpus

    @property
    def memory_bandwidth(self) -> float:
        return self.gpu.hbm_bandwidth * self.gpu.hbm_efficiency * self.gpus

    def kv_capacity_tokens(self, mem_fraction: float) -> int:
        """Tokens of KV the node's HBM holds after the weights, at `mem_fraction` of HBM."""
        free = self.gpu.hbm_bytes * self.gpus * mem_fraction - self.model.weight_bytes
        if free <= 0:
            raise ValueError(
                f"model {self.model.name!r} ({self.model.weight_bytes / 1e9:.0f} GB of weights) does not fit "
                f"in {self.gpus} x {self.gpu.name} at mem_fraction {mem_fraction}"
            )
        return int(free // self.model.kv_bytes_per_token)

    def prefill_seconds(self, tokens: int, context: int = 0) -> float:
        """Compute `tokens` new tokens that follow `context` cached ones."""
        if tokens <= 0:
            return 0.0
        m = self.model
        # sum over i in [context, context + tokens) of the attention context i
        attended = tokens * context + tokens * (tokens - 1) / 2
        flops = 2.0 * m.active_params * tokens + 4.0 * m.layers * m.q_heads * m.head_dim * attended
        return flops / self.flops

    def step_constant(self, batch: int) -> float:
        """a(B): the part of a decode step that does not depend on the contexts."""
        weights = self.model.weight_bytes / self.memory_bandwidth
        compute = 2.0 * self.model.active_params * batch / self.flops
        return self.step_overhead + max(weights, compute)

    @property
    def step_per_context_token(self) -> float:
        """b: seconds per token of context read in a decode step."""
        return self.model.kv_bytes_per_token / self.memory_bandwidth

    def step_seconds(self, batch: int, context_sum: int) -> float:
        return self.step_constant(batch) + self.step_per_context_token * context_sum


def steps_time(a: float, b: float, batch: int, context_sum: float, k: int) -> float:
    """Time of k decode steps starting with contexts summing to `context_sum`: step j (from 0)
    takes a + b * (context_sum + batch * j)."""
    return k * (a + b * context_sum) + b * batch * k * (k - 1) / 2


def steps_within(a: float, b: float, batch: int, context_sum: float, elapsed: float) -> int:
    """The number of whole steps that fit in `elapsed` seconds (inverse of `steps_time`)."""
    if elapsed <= 0:
        return 0
    first = a + b * context_sum
    q = b * batch / 2
    if q == 0:
        k = int(elapsed // first)
    else:
        lin = first - q
        k = int((-lin + math.sqrt(lin * lin + 4 * q * elapsed)) / (2 * q))
    # Guard the float root against off-by-one in either direction.
    while k > 0 and steps_time(a, b, batch, context_sum, k) > elapsed:
        k -= 1
    while steps_time(a, b, batch, context_sum, k + 1) <= elapsed:
        k += 1
    return k
