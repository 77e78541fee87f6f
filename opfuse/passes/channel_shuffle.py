"""Channel shuffles (ShuffleNet's Reshape -> Transpose -> Reshape over the channels) become
permutations that the neighbouring ops absorb, so no copy is ever made of a shuffled tensor.

A shuffle is a channel gather `Y[:, k] = X[:, perm[k]]` by constant indices. The pass rewrites each
one as a `Gather` along axis 1 and moves those gathers down the graph until they disappear:

- a Slice or a Split of the channels, or another channel gather, composes into the indices;
- a convolution (group 1, constant weight) reading the gathered channels reads `X` instead, with
  its weight's input channels placed at the indices (zeros elsewhere); at most 2x the weight, so at
  most 2x its multiply-adds (ShuffleNet's 1x1 conv reads half of the shuffled channels);
- a depthwise convolution or a one-input activation of a permutation runs on `X` (the depthwise
  weight permuted) and the permutation moves to its output;
- a Concat of gathered channels concatenates the runs of `X` they come from (Slices: views), and
  the permutation moves to the Concat's output.

A gather none of these absorbs stays (a copy, one launch). Every rewrite computes the same values.
"""

from __future__ import annotations

import itertools

import numpy as np

from opfuse.frontend import rule_registry as names
from opfuse.graph import Graph, Node, TensorSpec
from opfuse.passes.rules import RuleLog

RULE = names.FOLD_CHANNEL_SHUFFLE
MAX_WEIGHT_GROWTH = 2  # a conv reading a gathered subset: its weight grows by C_X / len(indices)
ACTIVATIONS = ("Relu", "LeakyRelu", "Sigmoid", "Tanh", "HardSigmoid", "HardSwish", "Elu", "Selu", "Softplus")


class _Names:
    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.count = itertools.count()

    def value(self, like: str, shape: tuple[int, ...], dtype: str | None = None) -> str:
        name = f"shuffle_v{next(self.count)}"
        while name in self.graph.values:
            name = f"shuffle_v{next(self.count)}"
        self.graph.values[name] = TensorSpec(name, dtype or self.graph.spec(like).dtype, shape)
        return name

    def constant(self, array: np.ndarray, dtype: str) -> str:
        return self.graph.add_constant(self.value("", tuple(array.shape), dtype), array, dtype)

    def node_id(self, base: str) -> str:
        ids = {n.id for n in self.graph.nodes}
        while True:
            nid = f"{base}s{next(self.count)}"
            if nid not in ids:
                return nid


def _shuffle(graph: Graph, r2: Node) -> tuple[list[Node], np.ndarray] | None:
    """(the three nodes, the gather indices) if `r2` ends Reshape -> Transpose -> Reshape that
    splits the channels of a 4-D tensor in groups and interleaves them."""
    if r2.op_type != "Reshape":
        return None
    producers, consumers = graph.producers(), graph.consumers()
    t = producers.get(r2.inputs[0])
    if t is None or t.op_type != "Transpose" or [int(p) for p in t.attrs.get("perm", [])] != [0, 2, 1, 3, 4]:
        return None
    r1 = producers.get(t.inputs[0])
    if r1 is None or r1.op_type != "Reshape":
        return None
    x = graph.spec(r1.inputs[0]).shape
    mid = graph.spec(r1.outputs[0]).shape
    if len(x) != 4 or graph.spec(r2.outputs[0]).shape != x or len(mid) != 5:
        return None
    if (mid[0], mid[1] * mid[2], mid[3], mid[4]) != x:
        return None
    outputs = {o.name for o in graph.outputs}
    for v in (r1.outputs[0], t.outputs[0]):
        if v in outputs or len(consumers.get(v, [])) != 1:
            return None
    groups, per = mid[1], mid[2]
    k = np.arange(x[1])
    return [r1, t, r2], (k % groups) * per + k // groups


def _constant_ints(graph: Graph, name: str) -> list[int] | None:
    arr = graph.constants.get(name) if name else None
    return None if arr is None else [int(v) for v in np.asarray(arr).reshape(-1)]


def _channel_slice(graph: Graph, node: Node, channels: int) -> tuple[int, int] | None:
    """[start, end) of a Slice that cuts only axis 1 with step 1."""
    if node.op_type != "Slice" or len(node.inputs) < 3:
        return None
    starts, ends = _constant_ints(graph, node.inputs[1]), _constant_ints(graph, node.inputs[2])
    axes = _constant_ints(graph, node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] else None
    steps = _constant_ints(graph, node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] else None
    if starts is None or ends is None:
        return None
    axes = axes if axes is not None else list(range(len(starts)))
    if [a % 4 for a in axes] != [1] or (steps is not None and steps != [1]):
        return None
    start, end = starts[0], ends[0]
    start = max(0, min(channels, start + channels if start < 0 else start))
    end = max(0, min(channels, end + channels if end < 0 else end))
    return (start, end) if end > start else None


class _Folder:
    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.names = _Names(graph)
        self.outputs = {o.name for o in graph.outputs}
        self.mine: set[str] = set()  # ids of the gathers this pass made

    def gather(self, x: str, idx: np.ndarray, out: str, base_id: str) -> Node:
        shape = self.graph.spec(x).shape
        assert len(shape) == 4
        ind = self.names.constant(np.asarray(idx, dtype=np.int64), "int64")
        node = Node(self.names.node_id(base_id), "Gather", [x, ind], [out], {"axis": 1}, "channel shuffle")
        self.mine.add(node.id)
        return node

    def absorb(self, g: Node) -> bool:
        """Move gather `g` into or past each of its readers; True if the graph changed."""
        graph = self.graph
        x, idx = g.inputs[0], np.asarray(graph.constants[g.inputs[1]]).reshape(-1)
        y = g.outputs[0]
        if y in self.outputs:
            return False
        readers = graph.consumers().get(y, [])
        changed = False
        for u in readers:
            new = self._rewrite(u, x, idx, y)
            if new is None:
                continue
            at = graph.nodes.index(u)
            graph.nodes[at : at + 1] = new
            changed = True
        if not graph.consumers().get(y):
            graph.nodes.remove(g)
        return changed

    def _rewrite(self, u: Node, x: str, idx: np.ndarray, y: str) -> list[Node] | None:
        graph = self.graph
        cx = graph.spec(x).shape[1]
        permutation = len(idx) == cx and len(set(idx.tolist())) == cx
        if u.op_type == "Gather" and u.inputs[0] == y and int(u.attrs.get("axis", 0)) % 4 == 1:
            inner = _constant_ints(graph, u.inputs[1])
            if inner is None or len(graph.spec(u.inputs[1]).shape) != 1:
                return None
            return [self.gather(x, idx[np.asarray(inner)], u.outputs[0], u.id)]
        if u.op_type == "Slice" and u.inputs[0] == y:
            window = _channel_slice(graph, u, len(idx))
            if window is None:
                return None
            return [self.gather(x, idx[window[0] : window[1]], u.outputs[0], u.id)]
        if u.op_type == "Split" and u.inputs[0] == y and int(u.attrs.get("axis", 0)) % 4 == 1:
            # ShuffleNet's chunk of the shuffled channels, as the dynamo exporter writes it: each
            # part is a gather of its window of the indices.
            sizes = [graph.spec(o).shape[1] for o in u.outputs]
            if sum(sizes) != len(idx) or any(not o for o in u.outputs):
                return None
            ends = np.cumsum(sizes).tolist()
            return [
                self.gather(x, idx[end - size : end], o, f"{u.id}_{k}")
                for k, (o, size, end) in enumerate(zip(u.outputs, sizes, ends, strict=True))
            ]
        if u.op_type == "Conv" and u.inputs[0] == y and u.inputs[1] in graph.constants:
            w = graph.constants[u.inputs[1]]
            group = int(u.attrs.get("group", 1))
            if group == 1 and w.shape[1] == len(idx) and cx <= MAX_WEIGHT_GROWTH * len(idx):
                if len(set(idx.tolist())) != len(idx):
                    return None
                wide = np.zeros((w.shape[0], cx, *w.shape[2:]), dtype=w.dtype)
                wide[:, idx] = w
                name = self.names.constant(wide, graph.spec(u.inputs[1]).dtype)
                return [Node(u.id, "Conv", [x, name, *u.inputs[2:]], list(u.outputs), dict(u.attrs), u.name)]
            if permutation and group == cx == w.shape[0] and w.shape[1] == 1:
                # Depthwise: filter j of channel idx[j] moves to idx[j]; the output is permuted alike.
                w2 = np.empty_like(w)
                w2[idx] = w
                ins = [x, self.names.constant(w2, graph.spec(u.inputs[1]).dtype)]
                if len(u.inputs) > 2 and u.inputs[2]:
                    if u.inputs[2] not in graph.constants:
                        return None
                    b = graph.constants[u.inputs[2]]
                    b2 = np.empty_like(b)
                    b2[idx] = b
                    ins.append(self.names.constant(b2, graph.spec(u.inputs[2]).dtype))
                out = u.outputs[0]
                mid = self.names.value(out, graph.spec(out).shape)
                conv = Node(u.id, "Conv", ins, [mid], dict(u.attrs), u.name)
                return [conv, self.gather(mid, idx, out, u.id)]
            return None
        if u.op_type in ACTIVATIONS and len(u.inputs) == 1 and permutation:
            out = u.outputs[0]
            mid = self.names.value(out, graph.spec(out).shape)
            act = Node(u.id, u.op_type, [x], [mid], dict(u.attrs), u.name)
            return [act, self.gather(mid, idx, out, u.id)]
        if u.op_type == "Concat" and int(u.attrs.get("axis", 0)) % 4 == 1 and u.inputs.count(y) == 1:
            if len(set(idx.tolist())) != len(idx):
                return None
            return self._concat(u, x, idx, y)
        return None

    def _concat(self, u: Node, x: str, idx: np.ndarray, y: str) -> list[Node]:
        """The gathered channels enter the Concat as the runs of `x` they come from, in order
        along `x`; the Concat's output is then a permutation of the result."""
        graph = self.graph
        order = np.sort(idx)
        runs: list[tuple[int, int]] = []
        for c in order.tolist():
            if runs and runs[-1][1] == c:
                runs[-1] = (runs[-1][0], c + 1)
            else:
                runs.append((c, c + 1))
        xs = graph.spec(x).shape
        new: list[Node] = []
        pieces: list[str] = []
        for a, b in runs:
            if (a, b) == (0, xs[1]):
                pieces.append(x)
                continue
            piece = self.names.value(x, (xs[0], b - a, xs[2], xs[3]))
            consts = [self.names.constant(np.asarray([v], dtype=np.int64), "int64") for v in (a, b, 1)]
            new.append(Node(self.names.node_id(u.id), "Slice", [x, *consts], [piece], {}, "channel shuffle"))
            pieces.append(piece)
        # Position of each gathered channel in the runs, then each Concat input's channels.
        position = {c: i for i, c in enumerate(order.tolist())}
        perm: list[int] = []
        ins: list[str] = []
        offset = 0
        for v in u.inputs:
            if v == y:
                perm += [offset + position[c] for c in idx.tolist()]
                ins += pieces
                offset += len(idx)
            else:
                n = graph.spec(v).shape[1]
                perm += list(range(offset, offset + n))
                ins.append(v)
                offset += n
        out = u.outputs[0]
        mid = self.names.value(out, graph.spec(out).shape)
        new.append(Node(u.id, "Concat", ins, [mid], dict(u.attrs), u.name))
        new.append(self.gather(mid, np.asarray(perm), out, u.id))
        return new


def fold_channel_shuffles(graph: Graph, log: RuleLog) -> None:
    folder = _Folder(graph)
    found = 0
    for node in list(graph.nodes):
        match = _shuffle(graph, node) if node in graph.nodes else None
        if match is None:
            continue
        nodes, idx = match
        x = nodes[0].inputs[0]
        at = graph.nodes.index(node)
        graph.nodes[at] = folder.gather(x, idx, node.outputs[0], node.id)
        for n in nodes[:2]:
            graph.nodes.remove(n)
        found += 1
    if not found:
        return
    # Push every channel gather down until none moves (each move goes strictly downstream).
    for _ in range(10 * len(graph.nodes)):
        gathers = [n for n in graph.nodes if n.id in folder.mine]
        if not any(folder.absorb(g) for g in gathers):
            break
    log.fired[RULE] = log.fired.get(RULE, 0) + found
