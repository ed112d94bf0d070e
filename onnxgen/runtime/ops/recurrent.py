"""RNN, GRU and LSTM (opsets 7-22): forward / reverse / bidirectional, sequence_lens, layouts.

The input projection of every time step is one matmul up front; the recurrence is a loop of
small ops per step. Rows past a batch item's sequence length keep their state and emit zeros,
decided on the device (no host read of sequence_lens), so fixed shapes could be recorded.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from onnxgen.runtime.node_contract import NodeContext
from onnxgen.runtime.ops.registry import implements

Activation = Callable[[torch.Tensor], torch.Tensor]

# name -> (needs alpha, needs beta, default alpha, default beta)
_ACTIVATION_PARAMS: dict[str, tuple[bool, bool, float, float]] = {
    "relu": (False, False, 0.0, 0.0),
    "tanh": (False, False, 0.0, 0.0),
    "sigmoid": (False, False, 0.0, 0.0),
    "affine": (True, True, 1.0, 0.0),
    "leakyrelu": (True, False, 0.01, 0.0),
    "thresholdedrelu": (True, False, 1.0, 0.0),
    "scaledtanh": (True, True, 1.0, 1.0),
    "hardsigmoid": (True, True, 0.2, 0.5),
    "elu": (True, False, 1.0, 0.0),
    "softsign": (False, False, 0.0, 0.0),
    "softplus": (False, False, 0.0, 0.0),
}


def _activation(name: str, alpha: float, beta: float) -> Activation:
    key = name.lower()
    if key == "relu":
        return torch.relu
    if key == "tanh":
        return torch.tanh
    if key == "sigmoid":
        return torch.sigmoid
    if key == "affine":
        return lambda x: x * alpha + beta
    if key == "leakyrelu":
        return lambda x: F.leaky_relu(x, alpha)
    if key == "thresholdedrelu":
        return lambda x: torch.where(x > alpha, x, torch.zeros_like(x))
    if key == "scaledtanh":
        return lambda x: torch.tanh(x * beta) * alpha
    if key == "hardsigmoid":
        return lambda x: torch.clamp(x * alpha + beta, 0.0, 1.0)
    if key == "elu":
        return lambda x: F.elu(x, alpha)
    if key == "softsign":
        return F.softsign
    if key == "softplus":
        return F.softplus
    raise ValueError(f"unknown recurrent activation {name!r}")


def _activations(ctx: NodeContext, defaults: list[str], num_directions: int) -> list[list[Activation]]:
    """Per direction, the activation functions; alpha/beta lists are consumed in order by the
    activations that take them (onnxruntime's convention), defaults filling the rest."""
    names = [str(n) for n in ctx.attr("activations", [])] or defaults * num_directions
    if len(names) == len(defaults) and num_directions == 2:
        names = names * 2
    if len(names) != len(defaults) * num_directions:
        raise ctx.fail(f"expected {len(defaults) * num_directions} activations, got {len(names)}")
    alphas = list(ctx.attr("activation_alpha", []))
    betas = list(ctx.attr("activation_beta", []))
    fns: list[Activation] = []
    for name in names:
        spec = _ACTIVATION_PARAMS.get(name.lower())
        if spec is None:
            raise ctx.fail(f"unknown activation {name!r}")
        needs_alpha, needs_beta, alpha, beta = spec
        if needs_alpha and alphas:
            alpha = float(alphas.pop(0))
        if needs_beta and betas:
            beta = float(betas.pop(0))
        fns.append(_activation(name, alpha, beta))
    per = len(defaults)
    return [fns[d * per : (d + 1) * per] for d in range(num_directions)]


class _Setup:
    """Shapes, layout handling and optional inputs shared by the three ops."""

    def __init__(self, ctx: NodeContext, x: torch.Tensor, w: torch.Tensor, gates: int):
        self.layout = int(ctx.attr("layout", 0))
        direction = str(ctx.attr("direction", "forward"))
        if direction not in ("forward", "reverse", "bidirectional"):
            raise ctx.fail(f"unknown direction {direction!r}")
        self.directions = ["forward", "reverse"] if direction == "bidirectional" else [direction]
        self.x = x.transpose(0, 1) if self.layout == 1 else x  # -> [S, B, I]
        self.seq, self.batch = self.x.shape[0], self.x.shape[1]
        self.hidden = int(ctx.attr("hidden_size", w.shape[1] // gates))
        self.clip = ctx.attr("clip")
        if len(self.directions) != w.shape[0]:
            raise ctx.fail(f"W has {w.shape[0]} directions, the direction attribute says {len(self.directions)}")

    def state(self, value: torch.Tensor | None) -> torch.Tensor:
        """An initial state as [D, B, H] (zeros when absent)."""
        if value is None:
            return self.x.new_zeros(len(self.directions), self.batch, self.hidden)
        return value.transpose(0, 1) if self.layout == 1 else value

    def valid(self, seq_lens: torch.Tensor | None) -> torch.Tensor | None:
        """[S, B, 1] True where the step is inside the batch item's sequence."""
        if seq_lens is None:
            return None
        steps = torch.arange(self.seq, device=self.x.device).view(-1, 1)
        return (steps < seq_lens.to(self.x.device).view(1, -1)).unsqueeze(-1)

    def pre(self, value: torch.Tensor) -> torch.Tensor:
        if self.clip is None:
            return value
        return value.clamp(-float(self.clip), float(self.clip))

    def outputs(self, ys: list[torch.Tensor], finals: list[list[torch.Tensor]]) -> tuple[torch.Tensor, ...]:
        y = torch.stack(ys, dim=1)  # [S, D, B, H]
        states = [torch.stack(f, dim=0) for f in finals]  # each [D, B, H]
        if self.layout == 1:
            y = y.permute(2, 0, 1, 3)
            states = [s.transpose(0, 1) for s in states]
        return (y, *states)


StepFn = Callable[[torch.Tensor, list[torch.Tensor]], list[torch.Tensor]]


def _scan(
    setup: _Setup,
    reverse: bool,
    valid: torch.Tensor | None,
    x_proj: torch.Tensor,
    state: list[torch.Tensor],
    step: StepFn,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Run one direction: ``step(x_proj[t], state) -> new state`` (state[0] is h). Returns Y, final state."""
    ys: list[torch.Tensor] = [x_proj.new_empty(0)] * setup.seq
    order = range(setup.seq - 1, -1, -1) if reverse else range(setup.seq)
    for t in order:
        new = step(x_proj[t], state)
        if valid is not None:  # past a sequence's end: keep the state, emit zeros
            keep = valid[t]
            new = [torch.where(keep, n, s) for n, s in zip(new, state)]
            ys[t] = torch.where(keep, new[0], torch.zeros_like(new[0]))
        else:
            ys[t] = new[0]
        state = new
    return torch.stack(ys, dim=0), state


def _biases(
    b: torch.Tensor | None, d: int, gates: int, hidden: int, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if b is None:
        zeros = like.new_zeros(gates * hidden)
        return zeros, zeros
    return b[d, : gates * hidden], b[d, gates * hidden :]


@implements("RNN", since=7)
def rnn(
    ctx: NodeContext,
    x: torch.Tensor,
    w: torch.Tensor,
    r: torch.Tensor,
    b: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    initial_h: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    setup = _Setup(ctx, x, w, 1)
    acts = _activations(ctx, ["Tanh"], len(setup.directions))
    h0 = setup.state(initial_h)
    valid = setup.valid(seq_lens)
    ys, hs = [], []
    for d, direction in enumerate(setup.directions):
        wb, rb = _biases(b, d, 1, setup.hidden, x)
        x_proj = torch.matmul(setup.x, w[d].t()) + wb + rb
        r_t = r[d].t()
        f = acts[d][0]

        def step(xp: torch.Tensor, state: list[torch.Tensor], r_t=r_t, f=f) -> list[torch.Tensor]:
            return [f(setup.pre(xp + state[0] @ r_t))]

        y, final = _scan(setup, direction == "reverse", valid, x_proj, [h0[d]], step)
        ys.append(y)
        hs.append(final[0])
    return setup.outputs(ys, [hs])[: max(ctx.num_outputs, 1)]


@implements("GRU", since=7)
def gru(
    ctx: NodeContext,
    x: torch.Tensor,
    w: torch.Tensor,
    r: torch.Tensor,
    b: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    initial_h: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    setup = _Setup(ctx, x, w, 3)
    acts = _activations(ctx, ["Sigmoid", "Tanh"], len(setup.directions))
    linear_before_reset = bool(ctx.attr("linear_before_reset", 0))
    h0 = setup.state(initial_h)
    valid = setup.valid(seq_lens)
    hid = setup.hidden
    ys, hs = [], []
    for d, direction in enumerate(setup.directions):
        wb, rb = _biases(b, d, 3, hid, x)
        # gate order z, r, h; the r·h product decides how the h gate's recurrent part is formed
        x_proj = torch.matmul(setup.x, w[d].t()) + wb
        r_zr = r[d, : 2 * hid].t()
        r_h = r[d, 2 * hid :].t()
        rb_zr, rb_h = rb[: 2 * hid], rb[2 * hid :]
        f, g = acts[d]

        def step(
            xp: torch.Tensor, state: list[torch.Tensor], r_zr=r_zr, r_h=r_h, rb_zr=rb_zr, rb_h=rb_h, f=f, g=g
        ) -> list[torch.Tensor]:
            h = state[0]
            zr = f(setup.pre(xp[:, : 2 * hid] + h @ r_zr + rb_zr))
            z, rr = zr[:, :hid], zr[:, hid:]
            if linear_before_reset:
                hh = g(setup.pre(xp[:, 2 * hid :] + rr * (h @ r_h + rb_h)))
            else:
                hh = g(setup.pre(xp[:, 2 * hid :] + (rr * h) @ r_h + rb_h))
            return [(1 - z) * hh + z * h]

        y, final = _scan(setup, direction == "reverse", valid, x_proj, [h0[d]], step)
        ys.append(y)
        hs.append(final[0])
    return setup.outputs(ys, [hs])[: max(ctx.num_outputs, 1)]


@implements("LSTM", since=7)
def lstm(
    ctx: NodeContext,
    x: torch.Tensor,
    w: torch.Tensor,
    r: torch.Tensor,
    b: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    initial_h: torch.Tensor | None = None,
    initial_c: torch.Tensor | None = None,
    p: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    setup = _Setup(ctx, x, w, 4)
    acts = _activations(ctx, ["Sigmoid", "Tanh", "Tanh"], len(setup.directions))
    input_forget = bool(ctx.attr("input_forget", 0))
    h0 = setup.state(initial_h)
    c0 = setup.state(initial_c)
    valid = setup.valid(seq_lens)
    hid = setup.hidden
    ys, hs, cs = [], [], []
    for d, direction in enumerate(setup.directions):
        wb, rb = _biases(b, d, 4, hid, x)
        x_proj = torch.matmul(setup.x, w[d].t()) + wb + rb  # gate order i, o, f, c
        r_t = r[d].t()
        if p is not None:
            p_i, p_o, p_f = p[d, :hid], p[d, hid : 2 * hid], p[d, 2 * hid :]
        else:
            p_i = p_o = p_f = None
        f, g, hfn = acts[d]

        def step(
            xp: torch.Tensor, state: list[torch.Tensor], r_t=r_t, p_i=p_i, p_o=p_o, p_f=p_f, f=f, g=g, hfn=hfn
        ) -> list[torch.Tensor]:
            h, c = state
            gates = xp + h @ r_t
            gi, go, gf, gc = gates[:, :hid], gates[:, hid : 2 * hid], gates[:, 2 * hid : 3 * hid], gates[:, 3 * hid :]
            if p_i is not None:
                gi = gi + p_i * c
                gf = gf + p_f * c
            i = f(setup.pre(gi))
            forget = 1 - i if input_forget else f(setup.pre(gf))
            cell = g(setup.pre(gc))
            c_new = forget * c + i * cell
            if p_o is not None:
                go = go + p_o * c_new
            o = f(setup.pre(go))
            return [o * hfn(c_new), c_new]

        y, final = _scan(setup, direction == "reverse", valid, x_proj, [h0[d], c0[d]], step)
        ys.append(y)
        hs.append(final[0])
        cs.append(final[1])
    return setup.outputs(ys, [hs, cs])[: max(ctx.num_outputs, 1)]
