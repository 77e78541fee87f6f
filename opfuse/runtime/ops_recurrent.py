"""Per-op torch kernels of the ONNX recurrent ops: RNN, GRU and LSTM.

One time step at a time, as the ONNX operators define them: the input's projection for every step
is one matmul up front, the recurrence a matmul and the gates' pointwise ops per step. Every
attribute is implemented: the three directions, both layouts, `clip`, LSTM's peepholes and
`input_forget`, GRU's `linear_before_reset`, and any of the activations ONNX names with their
alphas and betas. `sequence_lens` is read on the device (masks, no host copy): a batch entry's
steps past its length give zeros in Y and leave its state as it was, and the reverse direction
runs each entry's own steps backwards, as onnxruntime does.

Where an LSTM, GRU or RNN is what torch's own layers compute (the default activations, or Relu
for an RNN; no clip, no peepholes or coupled gates, no sequence_lens; for GRU
`linear_before_reset=1`, which is how torch.onnx.export writes torch.nn.GRU), it runs as
torch.lstm / torch.gru / torch.rnn_tanh / torch.rnn_relu instead: one cuDNN call for the node
(both directions of a bidirectional one) on the GPU rather than a handful of kernels per time step,
its weights put in torch's gate order and cuDNN's layout once, not every run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.backends.cudnn.rnn as cudnn_rnn
from torch.utils.weak import WeakIdKeyDictionary

from opfuse.errors import ModelError
from opfuse.runtime.ops_registry import OP_TABLE, optional, register, required

Inputs = list[torch.Tensor | None]
Attrs = dict[str, Any]
Act = Callable[[torch.Tensor], torch.Tensor]

# The activations the recurrent ops name, lower-cased: each is the ONNX op of that name (its
# kernel in OP_TABLE, its default alpha and beta), but Affine and ScaledTanh, which exist only as
# activations. The letters say which of activation_alpha / activation_beta a function consumes.
_ACTIVATION_OPS = {
    n.lower(): n
    for n in (
        "Relu",
        "Tanh",
        "Sigmoid",
        "Softsign",
        "Softplus",
        "LeakyRelu",
        "ThresholdedRelu",
        "HardSigmoid",
        "Elu",
    )
}
_TAKES = {
    "affine": "ab",
    "scaledtanh": "ab",
    "hardsigmoid": "ab",
    "leakyrelu": "a",
    "thresholdedrelu": "a",
    "elu": "a",
}


# Each op's activations (f, g, h) where the node names none.
_DEFAULT_ACTIVATIONS = {"LSTM": ["sigmoid", "tanh", "tanh"], "GRU": ["sigmoid", "tanh"], "RNN": ["tanh"]}


def _activation(name: str, given: Attrs) -> Act:
    """Activation `name` (lower-cased) with the alpha and beta `given` (the op's defaults else)."""
    if name == "affine":
        a, b = float(given.get("alpha", 1.0)), float(given.get("beta", 0.0))
        return lambda x: a * x + b
    if name == "scaledtanh":
        a, b = float(given.get("alpha", 1.0)), float(given.get("beta", 1.0))
        return lambda x: a * torch.tanh(b * x)
    impl = OP_TABLE[_ACTIVATION_OPS[name]].impl
    return lambda x: impl([x], given)[0]


def _activations(op_type: str, attrs: Attrs, directions: int) -> list[list[Act]]:
    """Each direction's activation functions, in the order the op consumes them. `activation_alpha`
    and `activation_beta` are consumed in order by the functions that take them."""
    defaults = _DEFAULT_ACTIVATIONS[op_type]
    names = [str(n) for n in attrs.get("activations", defaults * directions)]
    if len(names) == len(defaults) and directions == 2:
        names = names * 2
    if len(names) != len(defaults) * directions:
        raise ModelError(
            f"{op_type}: `activations` names {len(names)} functions where {len(defaults) * directions} "
            f"({len(defaults)} per direction) are needed"
        )
    alphas = [float(a) for a in attrs.get("activation_alpha", [])]
    betas = [float(b) for b in attrs.get("activation_beta", [])]
    fns: list[Act] = []
    for name in names:
        key = name.lower()
        if key not in _ACTIVATION_OPS and key not in _TAKES:
            raise ModelError(f"{op_type}: unknown activation function {name!r}")
        given: Attrs = {}
        if "a" in _TAKES.get(key, "") and alphas:
            given["alpha"] = alphas.pop(0)
        if "b" in _TAKES.get(key, "") and betas:
            given["beta"] = betas.pop(0)
        fns.append(_activation(key, given))
    per = len(defaults)
    return [fns[d * per : (d + 1) * per] for d in range(directions)]


class _Recurrence:
    """What RNN, GRU and LSTM share: the inputs in [seq, batch, ...] order, the directions, the
    step masks of `sequence_lens`, and Y and the final states in the model's layout."""

    def __init__(self, op_type: str, inputs: Inputs, attrs: Attrs, gates: int) -> None:
        self.op_type = op_type
        x = required(inputs, 0, op_type)
        self.layout = int(attrs.get("layout", 0))
        self.x = x.transpose(0, 1) if self.layout else x  # [seq, batch, input]
        self.w = required(inputs, 1, op_type)
        self.r = required(inputs, 2, op_type)
        self.b = optional(inputs, 3)
        direction = str(attrs.get("direction", "forward"))
        if direction not in ("forward", "reverse", "bidirectional"):
            raise ModelError(f"{op_type}: direction {direction!r} is not forward, reverse or bidirectional")
        self.reverse = [False, True] if direction == "bidirectional" else [direction == "reverse"]
        self.hidden = int(attrs.get("hidden_size", self.r.shape[-1]))
        if self.w.shape[0] != len(self.reverse) or self.w.shape[1] != gates * self.hidden:
            raise ModelError(
                f"{op_type}: W has shape {list(self.w.shape)}, not [{len(self.reverse)}, "
                f"{gates * self.hidden}, input_size] for direction {direction!r} and hidden_size {self.hidden}"
            )
        clip = attrs.get("clip")
        self.clip = float(clip) if clip is not None else None
        seq, batch = self.x.shape[0], self.x.shape[1]
        lens = optional(inputs, 4)
        self.lens: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None
        if lens is not None:
            # Clamped into [0, seq] on the device (a check would cost a host sync): a length past
            # the sequence reads as all of it, a negative one as none, never an index outside it.
            self.steps = torch.arange(seq, device=x.device)
            self.lens = lens.to(device=x.device, dtype=torch.int64).reshape(batch).clamp(0, seq)
            self.valid = (self.steps[:, None] < self.lens[None, :]).unsqueeze(-1)  # [seq, batch, 1]

    def initial(self, inputs: Inputs, index: int) -> torch.Tensor:
        """initial_h or initial_c as [directions, batch, hidden] (zeros where absent)."""
        t = optional(inputs, index)
        if t is None:
            return self.x.new_zeros(len(self.reverse), self.x.shape[1], self.hidden)
        return t.transpose(0, 1) if self.layout else t

    def clipped(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.clip is None else torch.clamp(t, -self.clip, self.clip)

    def order(self, t: torch.Tensor, reverse: bool) -> torch.Tensor:
        """`t` [seq, batch, ...] with each batch entry's own steps in the direction's order: all
        steps reversed, or with sequence_lens only the first len[b] of entry b (the rest stay)."""
        if not reverse:
            return t
        if self.lens is None:
            return t.flip(0)
        idx = torch.where(
            self.steps[:, None] < self.lens[None, :],
            self.lens[None, :] - 1 - self.steps[:, None],
            self.steps[:, None],
        )
        idx = idx.reshape(*idx.shape, *([1] * (t.dim() - 2))).expand_as(t)
        return torch.gather(t, 0, idx)

    def keep(self, step: int, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        """The state after step `step`: `new` where the entry's sequence has that step, else `old`."""
        return new if self.valid is None else torch.where(self.valid[step], new, old)

    def outputs(self, ys: list[torch.Tensor], finals: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        """Y [seq, directions, batch, hidden] and each final state [directions, batch, hidden] from
        each direction's, in the model's layout."""
        return self.layout_outputs(torch.stack(ys, 1), [torch.stack(f, 0) for f in finals])

    def layout_outputs(self, y: torch.Tensor, states: list[torch.Tensor]) -> list[torch.Tensor]:
        """Y [seq, directions, batch, hidden] and the final states [directions, batch, hidden] in
        the model's layout."""
        if self.layout:
            y = y.permute(2, 0, 1, 3)
            states = [s.transpose(0, 1) for s in states]
        return [y, *states]


def _directions(
    rec: _Recurrence, gates: int
) -> list[tuple[int, bool, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per direction: its index, whether it runs backwards, X·Wᵀ + Wb for every step ([seq,
    batch, gates·hidden], in the direction's step order), R, and Rb."""
    out = []
    for d, reverse in enumerate(rec.reverse):
        x = rec.order(rec.x, reverse)
        xw = torch.matmul(x, rec.w[d].transpose(0, 1))
        rb = rec.x.new_zeros(gates * rec.hidden)
        if rec.b is not None:
            xw = xw + rec.b[d, : gates * rec.hidden]
            rb = rec.b[d, gates * rec.hidden :]
        out.append((d, reverse, xw, rec.r[d], rb))
    return out


def _finish(rec: _Recurrence, d: int, reverse: bool, hs: list[torch.Tensor]) -> torch.Tensor:
    """The direction's Y [seq, batch, hidden] in time order, zeros past each entry's length."""
    y = torch.stack(hs, 0)
    if rec.valid is not None:
        y = torch.where(rec.valid, y, torch.zeros_like(y))
    return rec.order(y, reverse)


# ONNX's gate blocks, in torch's order: LSTM's i, o, f, c -> i, f, c(g), o; GRU's z, r, h -> r, z, n.
_TORCH_GATES = {"LSTM": (0, 2, 3, 1), "GRU": (1, 0, 2), "RNN": (0,)}


def _rnn_activation(attrs: Attrs) -> str:
    names = {str(n).lower() for n in attrs.get("activations", ["tanh"])}
    return names.pop() if len(names) == 1 else ""


def _library_form(op_type: str, inputs: Inputs, attrs: Attrs) -> bool:
    """Whether torch.lstm / torch.gru / torch.rnn_tanh / torch.rnn_relu compute exactly this node."""
    names = [str(n).lower() for n in attrs.get("activations", [])]
    defaults = _DEFAULT_ACTIVATIONS[op_type]
    if op_type == "RNN":
        if _rnn_activation(attrs) not in ("tanh", "relu"):
            return False
    elif names and names not in (defaults, defaults * 2):
        return False
    if attrs.get("clip") is not None or optional(inputs, 4) is not None:
        return False
    if op_type == "LSTM":
        return not int(attrs.get("input_forget", 0)) and optional(inputs, 7) is None
    if op_type == "GRU":
        return bool(int(attrs.get("linear_before_reset", 0)))
    return True


def _torch_gates(t: torch.Tensor, op_type: str) -> torch.Tensor:
    blocks = t.chunk(len(_TORCH_GATES[op_type]), 0)
    return torch.cat([blocks[i] for i in _TORCH_GATES[op_type]], 0)


# A node's weights in torch's gate order, made once per weight tensor: a plan's weights are the
# executor's constants, the same tensors every run, so a run reorders nothing. Keyed weakly by W
# (an entry goes with its weights); it holds R and B, and is used only for the same R and B, the
# same op and no write to any of them since (their versions).
_PREPARED = WeakIdKeyDictionary()
_CUDNN_MODES = {"LSTM": "LSTM", "GRU": "GRU", "tanh": "RNN_TANH", "relu": "RNN_RELU"}


def _torch_params(op_type: str, rec: _Recurrence, act: str) -> list[torch.Tensor]:
    """Every direction's w_ih, w_hh, b_ih, b_hh in torch's gate order (the ONNX node's W, R, B).
    On the GPU they are views into one buffer laid out as cuDNN wants it, as torch's
    `flatten_parameters` leaves a layer's weights: cuDNN then copies nothing per call."""
    versions = [t._version for t in (rec.w, rec.r, rec.b) if t is not None]
    hit = _PREPARED.get(rec.w)
    if hit is not None and hit[0] is rec.r and hit[1] is rec.b and hit[2] == (op_type, act, versions):
        return hit[3]
    gates = len(_TORCH_GATES[op_type])
    # New tensors, never the constants' views (torch.cat copies): the cuDNN packing below points
    # them into its buffer.
    params: list[torch.Tensor] = []
    for d in range(len(rec.reverse)):
        params += [_torch_gates(rec.w[d], op_type), _torch_gates(rec.r[d], op_type)]
        if rec.b is not None:
            params += [
                _torch_gates(rec.b[d, : gates * rec.hidden], op_type),
                _torch_gates(rec.b[d, gates * rec.hidden :], op_type),
            ]
        else:
            params += [rec.x.new_zeros(gates * rec.hidden), rec.x.new_zeros(gates * rec.hidden)]
    capturing = rec.x.is_cuda and torch.cuda.is_current_stream_capturing()
    if capturing:  # made inside a CUDA graph: its contents exist only in replays, so never kept
        return params
    if (
        rec.x.is_cuda
        and torch._use_cudnn_rnn_flatten_weight()
        and all(p.dtype == rec.x.dtype and torch.backends.cudnn.is_acceptable(p) for p in params)
    ):
        mode = cudnn_rnn.get_cudnn_mode(_CUDNN_MODES[op_type if op_type != "RNN" else act])
        with torch.no_grad(), torch.cuda.device_of(params[0]):
            torch._cudnn_rnn_flatten_weight(
                params, 4, rec.x.shape[-1], mode, rec.hidden, 0, 1, False, len(rec.reverse) == 2
            )
    _PREPARED[rec.w] = (rec.r, rec.b, (op_type, act, versions), params)
    return params


def prepared_weights() -> list[torch.Tensor]:
    """Every weight `_torch_params` keeps (runtime/capture.py counts them as device tensors, as a
    GPU's warm-up run makes them there before a capture)."""
    return [p for entry in list(_PREPARED.values()) for p in entry[3]]


def _library(op_type: str, rec: _Recurrence, inputs: Inputs, act: str = "") -> list[torch.Tensor]:
    """The node as torch's LSTM, GRU or Elman RNN (`act`: tanh or relu): one call for both
    directions of a bidirectional node (cuDNN runs them side by side), a reverse-only node on the
    reversed sequence."""
    params = _torch_params(op_type, rec, act)
    h0 = rec.initial(inputs, 5).contiguous()
    both = len(rec.reverse) == 2
    reverse = rec.reverse == [True]
    x = rec.x.flip(0) if reverse else rec.x
    if op_type == "LSTM":
        state: Any = (h0, rec.initial(inputs, 6).contiguous())
        y, *finals = torch.lstm(x, state, params, True, 1, 0.0, False, both, False)
    else:
        fn = torch.gru if op_type == "GRU" else (torch.rnn_relu if act == "relu" else torch.rnn_tanh)
        y, h = fn(x, h0, params, True, 1, 0.0, False, both, False)
        finals = [h]
    if reverse:
        y = y.flip(0)
    seq, batch = y.shape[0], y.shape[1]
    y = y.view(seq, batch, len(rec.reverse), rec.hidden).transpose(1, 2)  # [seq, directions, batch, hidden]
    return rec.layout_outputs(y, finals)


State = tuple[torch.Tensor, ...]
Step = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, State], State]


def _scan(rec: _Recurrence, gates: int, initial: list[torch.Tensor], step: Step) -> list[torch.Tensor]:
    """Each direction step by step from its `initial` states ([directions, batch, hidden] each,
    h first): `step(direction, X·Wᵀ + Wb of the step, R, Rb, states)` gives the new states, kept
    only where the entry's sequence has the step. Returns Y and the final states."""
    ys: list[torch.Tensor] = []
    finals: list[list[torch.Tensor]] = [[] for _ in initial]
    for d, reverse, xw, r, rb in _directions(rec, gates):
        state = tuple(s[d] for s in initial)
        hs = []
        for t in range(xw.shape[0]):
            new = step(d, xw[t], r, rb, state)
            state = tuple(rec.keep(t, a, b) for a, b in zip(new, state, strict=True))
            hs.append(state[0])
        ys.append(_finish(rec, d, reverse, hs))
        for f, last in zip(finals, state, strict=True):
            f.append(last)
    return rec.outputs(ys, finals)


@register("RNN")
def rnn(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    rec = _Recurrence("RNN", inputs, attrs, 1)
    if _library_form("RNN", inputs, attrs):
        return _library("RNN", rec, inputs, _rnn_activation(attrs))
    acts = _activations("RNN", attrs, len(rec.reverse))

    def step(d: int, xw: torch.Tensor, r: torch.Tensor, rb: torch.Tensor, state: State) -> State:
        (h,) = state
        return (acts[d][0](rec.clipped(xw + h @ r.T + rb)),)

    return _scan(rec, 1, [rec.initial(inputs, 5)], step)


@register("GRU")
def gru(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    rec = _Recurrence("GRU", inputs, attrs, 3)
    if _library_form("GRU", inputs, attrs):
        return _library("GRU", rec, inputs)
    acts = _activations("GRU", attrs, len(rec.reverse))
    before_reset = bool(int(attrs.get("linear_before_reset", 0)))
    n = rec.hidden

    def step(d: int, xw: torch.Tensor, r: torch.Tensor, rb: torch.Tensor, state: State) -> State:
        (h,) = state
        f, g = acts[d]
        hr = h @ r[: 2 * n].T + rb[: 2 * n]
        z = f(rec.clipped(xw[:, :n] + hr[:, :n]))
        rr = f(rec.clipped(xw[:, n : 2 * n] + hr[:, n:]))
        if before_reset:
            cand = xw[:, 2 * n :] + rr * (h @ r[2 * n :].T + rb[2 * n :])
        else:
            cand = xw[:, 2 * n :] + (rr * h) @ r[2 * n :].T + rb[2 * n :]
        return ((1 - z) * g(rec.clipped(cand)) + z * h,)

    return _scan(rec, 3, [rec.initial(inputs, 5)], step)


@register("LSTM")
def lstm(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    rec = _Recurrence("LSTM", inputs, attrs, 4)
    if _library_form("LSTM", inputs, attrs):
        return _library("LSTM", rec, inputs)
    acts = _activations("LSTM", attrs, len(rec.reverse))
    input_forget = bool(int(attrs.get("input_forget", 0)))
    peep = optional(inputs, 7)
    n = rec.hidden
    # Each direction's peepholes (i, o, f), or none.
    peeps: list[tuple[Any, Any, Any]] = [(0.0, 0.0, 0.0)] * len(rec.reverse)
    if peep is not None:
        peeps = [(p[:n], p[n : 2 * n], p[2 * n :]) for p in peep]

    def step(d: int, xw: torch.Tensor, r: torch.Tensor, rb: torch.Tensor, state: State) -> State:
        h, c = state
        f, g, hf = acts[d]
        pi, po, pf = peeps[d]
        gates = xw + h @ r.T + rb  # i, o, f, c
        i = f(rec.clipped(gates[:, :n] + pi * c))
        fg = 1 - i if input_forget else f(rec.clipped(gates[:, 2 * n : 3 * n] + pf * c))
        c_new = fg * c + i * g(rec.clipped(gates[:, 3 * n :]))
        o = f(rec.clipped(gates[:, n : 2 * n] + po * c_new))
        return (o * hf(c_new), c_new)

    return _scan(rec, 4, [rec.initial(inputs, 5), rec.initial(inputs, 6)], step)
