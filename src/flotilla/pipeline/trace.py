"""Pipeline layers for a model that is not an ``nn.Sequential``: trace it, cut it at named modules.

A pipeline cuts a chain of layers, each taking one tensor and returning one.  A model written the
usual way (embeddings, a ``ModuleList`` of blocks looped in ``forward``, a final norm, a head tied
to the embedding) is not one; :func:`trace_layers` makes it one without rewriting it:

- the model is traced with ``torch.fx`` (symbolic tracing: ``torch.nn`` modules are leaves, the
  user's modules are traced through, every graph node records the module path it was called
  from).  ``forward``'s first parameter is the input; every further parameter must have a default,
  which the trace keeps (``concrete_args``: an ``HF``-style ``targets=None`` stays None);
- a **cut point** is the name of a module the model calls (``"blocks.2"``): the cut goes just
  before the first operation of that module's first call.  Exactly one value may cross a cut
  (the pipeline sends one tensor from stage to stage); a cut where two or more values are alive
  (a residual stream next to a branch, a mask handed to every block) is refused naming the point
  and the values;
- ``split_points`` names the cuts (in forward order); without them every module start where
  exactly one value crosses is a cut, the heterogeneity-aware partitioner then groups the layers
  into stages (``pipeline/split.py``), as for an ``nn.Sequential``;
- the layers are the pieces of ``torch.fx.passes.split_module``: ``GraphModule``s that hold the
  ORIGINAL module objects and parameters (no copy), so a parameter tied across pieces is one
  tensor, found by ``model_check.tied_parameters`` like any other tie, and the user's untraced
  model -- the object that was traced -- holds every trained weight: its ``state_dict()`` is what
  ``model.safetensors`` exports, loadable with ``strict=True`` into the user's own class;
- what tracing cannot keep is refused in one line naming the module: Python control flow on a
  tensor's value, and a ``forward`` that reads ``self.training`` outside a ``torch.nn`` module
  (``F.dropout(x, training=self.training)``): the trace would freeze it, so the model is traced in
  train and in eval mode and the two graphs must agree.

Assumption: the traced graph is the model's forward for every input of the job's shape (what
``torch.fx`` assumes: Python-level branches on shapes are taken once, at trace time).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Sequence
from typing import Any

from torch import fx, nn

from flotilla.core.errors import ConfigError

__all__ = ["LABEL_ATTR", "cut_candidates", "trace_layers", "traced_model"]

LABEL_ATTR = "flotilla_label"  # a traced layer's readable name (profiles, refusals)


class _PathTracer(fx.Tracer):
    """``fx.Tracer`` that remembers the innermost module a tracing error was raised in."""

    def __init__(self) -> None:
        super().__init__()
        self.proxy_buffer_attributes = True  # a buffer is read in the graph (a mask sliced to [:t])
        self.failed_in: str | None = None

    def call_module(self, m: nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_in is None:
                self.failed_in = self.path_of_module(m) or "<root>"
            raise


def _concrete_args(model: nn.Module, where: str) -> dict[str, Any]:
    params = list(inspect.signature(model.forward).parameters.values())
    if not params or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
        raise ConfigError(f"{where}: {type(model).__name__}.forward must take the input tensor first")
    fixed = {}
    for p in params[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.default is p.empty:
            raise ConfigError(
                f"{where}: {type(model).__name__}.forward takes a second input {p.name!r} without a "
                "default; a pipeline feeds one tensor to stage 0"
            )
        fixed[p.name] = p.default
    return fixed


def _trace_once(model: nn.Module, concrete: dict[str, Any], where: str) -> fx.GraphModule:
    tracer = _PathTracer()
    before = set(vars(model))
    try:
        graph = tracer.trace(model, concrete_args=concrete or None)
    except Exception as exc:  # any failure of the trace is the model's: one line naming where
        module = tracer.failed_in or "<root>"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"{where}: {type(model).__name__} cannot be traced for a pipeline (module {module}): "
            f"{type(exc).__name__}: {first}"
        ) from None
    if type(graph._codegen) is not fx.graph.CodeGen:  # (pytree codegen: a container default)
        _clean(model, before)
        raise ConfigError(
            f"{where}: {type(model).__name__}.forward has a default that is a tuple, list or dict; a "
            "traced pipeline keeps only plain defaults (None, numbers, strings, booleans)"
        )
    _drop_specialised_inputs(graph, model, where)
    gm = fx.GraphModule(tracer.root, graph, type(model).__name__)  # (holds the constants it reads)
    _clean(model, before)
    return gm


def _clean(model: nn.Module, before: set[str]) -> None:
    """Remove what the trace left on the user's model (``_tensor_constant<i>``: a tensor made in
    ``forward``), so the user's model is as it was and the next trace names them the same."""
    for name in set(vars(model)) - before:
        delattr(model, name)


_GUARDS = {"_assert_is_none", "_assert", "eq"}  # what fx adds to check a specialised argument


def _drop_specialised_inputs(graph: fx.Graph, model: nn.Module, where: str) -> None:
    """Remove every input but the first (fixed to its default by the trace) with fx's guards on it;
    an argument the forward uses beyond its default is refused."""
    for ph in [n for n in graph.nodes if n.op == "placeholder"][1:]:
        found, todo = [], list(ph.users)
        while todo:
            node = todo.pop()
            if node not in found:
                found.append(node)
                todo.extend(node.users)
        if any(n.op != "call_function" or getattr(n.target, "__name__", "") not in _GUARDS for n in found):
            name = re.sub(r"_\d+$", "", str(ph.target))
            raise ConfigError(
                f"{where}: {type(model).__name__}.forward uses its argument {name!r} "
                "beyond its default; a pipeline feeds one tensor to stage 0"
            )
        for node in sorted(found, key=lambda n: -list(graph.nodes).index(n)):
            graph.erase_node(node)
        graph.erase_node(ph)


def traced_model(model: nn.Module, *, where: str = "pipeline") -> fx.GraphModule:
    """``model`` traced by ``torch.fx`` (module doc); ConfigError (one line) for what cannot be."""
    concrete = _concrete_args(model, where)
    was_training = model.training
    try:
        model.train(True)
        train = _trace_once(model, concrete, where)
        model.train(False)
        evaluation = _trace_once(model, concrete, where)
    finally:
        model.train(was_training)
    if train.code != evaluation.code:
        raise ConfigError(
            f"{where}: {type(model).__name__}.forward changes with self.training outside a torch.nn "
            "module (e.g. F.dropout(x, training=self.training)); a traced pipeline would freeze it: "
            "use nn.Dropout (or another module) there"
        )
    train.train(was_training)
    return train


class _Graph:
    """The traced graph's nodes in order, where each module starts, what crosses each position."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.nodes = list(gm.graph.nodes)
        self.index = {n: i for i, n in enumerate(self.nodes)}
        self.starts: dict[str, int] = {}
        for i, n in enumerate(self.nodes):
            for path in n.meta.get("nn_module_stack", {}):
                self.starts.setdefault(str(path), i)
        ops = [i for i, n in enumerate(self.nodes) if n.op not in ("placeholder", "get_attr", "output")]
        self.first_op = ops[0] if ops else len(self.nodes)

    def crossing(self, i: int) -> list[fx.Node]:
        """The values defined before position ``i`` and used at or after it (get_attr excluded:
        every piece that reads an attribute holds it)."""
        return [n for n in self.nodes[:i] if n.op != "get_attr" and any(self.index[u] >= i for u in n.users)]

    def valid_cut(self, i: int) -> bool:
        return self.first_op < i < len(self.nodes) - 1 and len(self.crossing(i)) == 1


def cut_candidates(model: nn.Module, *, where: str = "pipeline") -> list[str]:
    """Every module start where one value crosses (outermost name per position), in forward order."""
    return _candidates(_Graph(traced_model(model, where=where)))


def _candidates(graph: _Graph) -> list[str]:
    seen: dict[int, str] = {}
    for path, i in graph.starts.items():  # (outer modules come first in a node's stack)
        if i not in seen and graph.valid_cut(i):
            seen[i] = path
    return [seen[i] for i in sorted(seen)]


def _cuts(graph: _Graph, points: Sequence[str], model: nn.Module, where: str) -> list[int]:
    cuts: list[int] = []
    for point in points:
        if point not in graph.starts:
            valid = _candidates(graph)
            raise ConfigError(
                f"{where}: split point {point!r} names no module {type(model).__name__} calls "
                f"(points where one tensor crosses: {', '.join(valid) or 'none'})"
            )
        i = graph.starts[point]
        if cuts and i <= cuts[-1]:
            raise ConfigError(
                f"{where}: split point {point!r} must come after the one before it in forward order"
            )
        crossing = graph.crossing(i)
        if i <= graph.first_op:
            raise ConfigError(f"{where}: split point {point!r} leaves the stage before it empty")
        if len(crossing) != 1:
            values = ", ".join(n.name for n in crossing)
            raise ConfigError(
                f"{where}: split point {point!r}: {len(crossing)} values cross it ({values}); a "
                "pipeline boundary carries one tensor: cut between blocks, not inside one"
            )
        cuts.append(i)
    return cuts


def _first_module(graph: _Graph) -> str:
    for n in graph.nodes:
        stack = list(n.meta.get("nn_module_stack", {}))
        if stack:
            return str(stack[0])
    return "input"


def trace_layers(
    model: nn.Module, split_points: Sequence[str] | None = None, *, where: str = "pipeline"
) -> nn.Sequential:
    """``model`` as an ``nn.Sequential`` of traced layers cut at ``split_points`` (default: every
    :func:`cut_candidates` point); the layers share ``model``'s modules and parameters."""
    gm = traced_model(model, where=where)
    graph = _Graph(gm)
    points = list(split_points) if split_points is not None else None
    if points is None:
        points = _candidates(graph)
    elif len(set(points)) != len(points):
        raise ConfigError(f"{where}: split points must differ, got {points}")
    cuts = _cuts(graph, points, model, where)
    bounds = [0, *cuts, len(graph.nodes) - 1]
    pieces = [_piece(gm, graph, bounds[k], bounds[k + 1]) for k in range(len(bounds) - 1)]
    for piece, label in zip(pieces, [_first_module(graph), *points]):
        setattr(piece, LABEL_ATTR, label)  # the module the layer starts with
    layers = nn.Sequential(*pieces)
    layers.train(model.training)
    return layers


def _piece(gm: fx.GraphModule, graph: _Graph, lo: int, hi: int) -> fx.GraphModule:
    """Nodes ``[lo, hi)`` as a module taking the one value crossing ``lo`` (the input for the
    first) and returning the one crossing ``hi`` (the model's output for the last); attributes it
    reads are the model's own objects (``fx.GraphModule`` copies references)."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    if lo > 0:
        (incoming,) = graph.crossing(lo)
        env[incoming] = g.placeholder(incoming.name)

    def value(node: fx.Node) -> fx.Node:
        if node not in env:  # (a get_attr read here; anything else crossed a checked cut)
            env[node] = g.node_copy(node, value)
        return env[node]

    for node in graph.nodes[lo:hi]:
        if node.op != "get_attr":
            env[node] = g.node_copy(node, value)
    last = graph.nodes[-1]
    if hi == len(graph.nodes) - 1:
        g.output(fx.node.map_arg(last.args[0], value))
    else:
        (outgoing,) = graph.crossing(hi)
        g.output(value(outgoing))
    return fx.GraphModule(gm, g, "TracedLayer")
