"""`gather_prologue`: an embedding lookup computed on the tiles of the row kernel that reads it.

A transformer's first kernel normalizes its embeddings: Gather(word table, token ids), plus the
position (and token type) embeddings, then a LayerNorm (RMSNorm in a decoder). The Gather is no
anchor and no pointwise op, so it ran as a library op of its own: one more launch (several on a
GPU, where the indices are normalized and clamped first) and the embedding written and read back.
Where a row kernel reads the Gather's output as its full-shaped input, and the Gather takes whole
rows of a constant 2-D table (axis 0, each row one row of the row kernel), each program loads its
rows' indices and reads the table's rows straight into its tile, for every such Gather the kernel
reads (word, position and token type embeddings: RoBERTa computes its position ids at run time).
Where the residual stream also needs an embedding (pre-norm decoders), the row kernel stores it too.

Out-of-range indices behave as the library's Gather: on the CPU the executor checks them before
the launch and raises the same error (`INDEX_CHECKS` in the kernel's source), on a GPU the kernel
clamps them into the table.
"""

from __future__ import annotations

from collections.abc import Iterator

from opfuse.frontend import rule_registry as names
from opfuse.fusion.groups import group_boundary, merge_refusal
from opfuse.fusion.rules.base import QUIET, Candidate, FusionRule
from opfuse.ir.rows import row_head, row_space

GATHER_PROLOGUE_RULE = names.GATHER_PROLOGUE
INDEX_TYPES = ("int64", "int32")


class GatherPrologue(FusionRule):
    def match(self) -> Iterator[Candidate]:
        """Each row group's input that a Gather no group holds writes: every one of them (word,
        position and token type embeddings), on a row kernel with no other prologue."""
        self.order = {n.id: i for i, n in enumerate(self.graph.nodes)}  # for the cycle check
        producers = self.graph.producers()
        self.held = self.state.held()
        for rg in self.state.rows:
            if rg.kind != "rowwise" or rg.views or any(n.op_type != "Gather" for n in rg.prologue):
                continue
            head = row_head(self.graph, rg.nodes)
            for x in list(rg.inputs):
                src = producers.get(x)
                if src is None or src.op_type != "Gather" or src.id in self.held:
                    continue
                yield Candidate(GATHER_PROLOGUE_RULE, [src, head], group=rg, data=x)

    def check(self, c: Candidate) -> str | None:
        graph, rg = self.graph, c.group
        assert rg is not None
        gather, head = c.nodes
        x = c.data
        table, ids = gather.inputs[0], gather.inputs[1]
        if table not in graph.constants or ids in graph.constants:
            return QUIET  # a constant's rows (folded) or indices into a computed tensor: not a lookup
        shape = graph.spec(table).shape
        if len(shape) != 2 or int(gather.attrs.get("axis", 0)) % 2 != 0:
            return "the Gather does not take whole rows of a 2-D table"
        if graph.spec(ids).dtype not in INDEX_TYPES:
            return f"indices of type {graph.spec(ids).dtype}"
        space = row_space(graph, head)
        full = space.full
        if space.groups or space.inner != 1 or space.first != len(full) - 1:
            return "the row kernel does not reduce over the table's rows"
        if tuple(graph.spec(x).shape) != full or shape[1] != space.r:
            return "the looked-up rows are not the row kernel's full-shaped input"
        why, _ = merge_refusal(graph, {gather.id, *(n.id for n in [*rg.prologue, *rg.nodes])}, self.order)
        return why

    def claim(self, c: Candidate) -> None:
        rg = c.group
        assert rg is not None
        gather = c.nodes[0]
        if not rg.prologue:
            rg.rule = f"{rg.rule}+{GATHER_PROLOGUE_RULE}"
        rg.prologue = [*rg.prologue, gather]
        # An embedding stays an output where others read it too (the residual stream).
        rg.inputs, rg.outputs = group_boundary(self.graph, [*rg.prologue, *rg.nodes])
        self.held.add(gather.id)  # one row kernel computes it


RULE = GatherPrologue
