"""The compiler's intermediate representation, below every stage.

It holds the graph itself and what the stages say about it, so that passes, fusion and codegen
import it and never one another:

- `graph`: `Graph`, `Node`, `TensorSpec` (`opfuse.graph` re-exports them beside
  `graph_from_onnx`, which builds a graph from ONNX);
- `ops`: the internal op names (`opfuse.ConvNHWC`, ...), the op sets stages agree on, and
  predicates on single nodes (`is_depthwise`, `has_shortcut`);
- `queries`: graph queries (`scalar_constant`, `contiguous_strides`) and `UseDef`, the producers
  and consumers of every value, computed once for a stage that reads the graph without changing it;
- `support`, `rows`: what the kernel templates compute, asked by fusion before it plans a group
  and honoured by codegen when it writes one (a reason string where a template cannot);
- `views`, `resize`: the descriptions fusion hands to codegen (strided views, attention matches,
  Resize gathers).
"""
