"""jraph and tinygp: a graph attention network and a deep-kernel Gaussian process.

* jraph: two ``jraph.GAT`` layers (attention normalised by ``jraph.segment_softmax``, which takes a
  ``segment_max`` over each node's incoming edges), a ``jraph.GraphConvolution`` with symmetric
  degree normalisation, and a per-graph max readout (``jraph.segment_max``) over two graphs batched
  with ``jraph.batch``. Segment maxima are ``scatter-max``; scalify had no rule for it.
* tinygp: an MLP feature map under an ``ExpSquared`` kernel, trained by the GP's marginal log
  likelihood ``GaussianProcess.log_probability`` (Cholesky factor, triangular solves, log
  determinant), the route of deep kernel learning. scalify had no rule for ``cholesky``.

Both libraries are written for plain jax.numpy: the models below use their public API only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from thirdparty_harness import Case, StepResults, check_grad, check_update, run_loss

jraph = pytest.importorskip("jraph", reason="jraph is not installed (pip install -e '.[test]')")
tinygp = pytest.importorskip("tinygp", reason="tinygp is not installed (pip install -e '.[test]')")

CLASSES = 4


def _linear(rng, d_in, d_out):
    w = (rng.standard_normal((d_in, d_out)) / np.sqrt(d_in)).astype(np.float32)
    return {"w": w, "b": np.zeros(d_out, np.float32)}


def _apply(p, x):
    return x @ p["w"] + p["b"]


def _graph(rng, n_node, n_edge, d):
    return jraph.GraphsTuple(
        nodes=jnp.asarray(rng.standard_normal((n_node, d)), jnp.float32),
        edges=None,
        senders=jnp.asarray(rng.integers(0, n_node, n_edge), jnp.int32),
        receivers=jnp.asarray(rng.integers(0, n_node, n_edge), jnp.int32),
        globals=None,
        n_node=jnp.asarray([n_node]),
        n_edge=jnp.asarray([n_edge]),
    )


def gat_case(d_model=32):
    """Node width ``d_model`` (a multiple of 32), two graphs of 12 and 9 nodes."""
    rng = np.random.default_rng(11)
    graph = jraph.batch([_graph(rng, 12, 40, d_model), _graph(rng, 9, 25, d_model)])
    labels = jnp.asarray([1, 3], jnp.int32)
    params = {
        "gat1": _linear(rng, d_model, d_model),
        "att1": _linear(rng, 2 * d_model, 1),
        "gat2": _linear(rng, d_model, d_model),
        "att2": _linear(rng, 2 * d_model, 1),
        "gcn": _linear(rng, d_model, d_model),
        "head": _linear(rng, d_model, CLASSES),
    }

    def gat(query, logit):
        return jraph.GAT(
            attention_query_fn=lambda nodes: _apply(query, nodes),
            attention_logit_fn=lambda s, r, e: jax.nn.leaky_relu(_apply(logit, jnp.concatenate([s, r], axis=-1))),
            node_update_fn=jax.nn.elu,
        )

    def loss(params, batch):
        graph, labels = batch
        graph = gat(params["gat1"], params["att1"])(graph)
        graph = gat(params["gat2"], params["att2"])(graph)
        gcn = jraph.GraphConvolution(lambda nodes: _apply(params["gcn"], nodes), add_self_edges=True)
        graph = gcn(graph)
        n_graph = graph.n_node.shape[0]
        node_graph = jnp.repeat(jnp.arange(n_graph), graph.n_node, total_repeat_length=graph.nodes.shape[0])
        pooled = jraph.segment_max(graph.nodes, node_graph, n_graph)
        logits = _apply(params["head"], pooled)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    return Case("jraph_gat", loss, params, (graph, labels))


def deep_kernel_gp_case(d_model=32, n=48):
    """A two-layer tanh MLP of width ``d_model`` maps 8 inputs to ``d_model`` features; the GP's
    noise variance (0.1) keeps the kernel matrix's condition number below ~500, so float32
    rounding of its entries moves the log likelihood by far less than the suite's tolerance."""
    from tinygp import GaussianProcess, kernels

    rng = np.random.default_rng(12)
    x = jnp.asarray(rng.uniform(-1, 1, (n, 8)), jnp.float32)
    y = jnp.sin(3 * x[:, 0]) + 0.5 * x[:, 1] ** 2
    params = {
        "l1": _linear(rng, 8, d_model),
        "l2": _linear(rng, d_model, d_model),
        "log_amp": np.float32(0.0),
        "log_scale": np.float32(1.0),
    }

    def loss(params, batch):
        x, y = batch
        features = _apply(params["l2"], jnp.tanh(_apply(params["l1"], x)))
        kernel = jnp.exp(params["log_amp"]) * kernels.ExpSquared(scale=jnp.exp(params["log_scale"]))
        gp = GaussianProcess(kernel, features, diag=0.1)
        return -gp.log_probability(y) / n

    return Case("tinygp_deep_kernel", loss, params, (x, y))


CASES = {"jraph_gat": gat_case, "tinygp_deep_kernel": deep_kernel_gp_case}


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    return CASES[request.param]()


STEPS = StepResults()


def test_loss(case, fmt_name):
    run_loss(case, fmt_name)


@pytest.mark.slow
def test_grad(case, fmt_name):
    check_grad(STEPS, case, fmt_name)


@pytest.mark.slow
def test_adam_update(case, fmt_name):
    check_update(STEPS, case, fmt_name)
