"""What the server's /metrics endpoint exposes, under vLLM's metric names with a `tsengine:` prefix.

Engine counters (speculation acceptance, queue sizes, KV use) are read from the engine at scrape time
rather than copied on every step; request-level counters and latency histograms are fed by the server
as outputs reach it.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class _EngineCollector:
    """Engine counters read at scrape time (ints written by the engine thread; a read is atomic)."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        e, st = self.engine, self.engine.stats
        for name, value, doc in (("num_drafts", st.num_drafts, "verify steps (draft chains checked)"),
                                 ("num_draft_tokens", st.num_draft_tokens, "draft tokens proposed"),
                                 ("num_accepted_tokens", st.num_accepted, "draft tokens accepted")):
            yield CounterMetricFamily(f"tsengine:spec_decode_{name}", f"Speculative decoding: {doc}.", value=value)
        per = CounterMetricFamily("tsengine:spec_decode_num_accepted_tokens_per_pos",
                                  "Draft tokens accepted, by draft position.", labels=["position"])
        for i, v in enumerate(list(st.accepted_per_pos)):
            per.add_metric([str(i)], v)
        yield per
        drafted = CounterMetricFamily("tsengine:spec_decode_num_drafted_tokens_per_pos",
                                      "Verify steps that drafted this position (acceptance rate = accepted / "
                                      "drafted; adaptive speculation does not always draft every position).",
                                      labels=["position"])
        for i, v in enumerate(list(st.drafted_per_pos)):
            drafted.add_metric([str(i)], v)
        yield drafted
        snap = e.snapshot()
        if snap.policy is not None:
            yield from _policy_metrics(snap.policy)
        if snap.prefix_queries is not None:  # vLLM's pair: prompt tokens looked up, and of those found cached
            yield CounterMetricFamily("tsengine:prefix_cache_queries", "Prefix cache: prompt tokens looked up.",
                                      value=snap.prefix_queries)
            yield CounterMetricFamily("tsengine:prefix_cache_hits", "Prefix cache: prompt tokens found cached.",
                                      value=snap.prefix_hits)
        yield CounterMetricFamily("tsengine:compiled_graphs", "Step graphs compiled (or loaded from torch's cache) "
                                  "so far (docs/design/graphs.md).", value=snap.compiled_graphs)
        yield GaugeMetricFamily("tsengine:compiling_graphs", "Step graphs waiting for or in their compile, off the "
                                "engine thread; their steps run eagerly meanwhile.", value=snap.compiling_graphs)
        yield GaugeMetricFamily("tsengine:num_requests_running", "Requests scheduled.", value=snap.running)
        yield GaugeMetricFamily("tsengine:num_requests_waiting", "Requests queued.", value=snap.waiting)
        yield GaugeMetricFamily("tsengine:kv_cache_usage_perc", "Fraction of KV blocks in use.",
                                value=snap.kv_cache_usage)


def _policy_metrics(policy):
    """Adaptive speculation's running estimates, fitted costs and choices (tsengine/speculative/adaptive/policy.py)."""
    yield GaugeMetricFamily("tsengine:spec_decode_draft_length", "Draft length (chain) or depth (tree) chosen for "
                            "the last step (0: plain decoding).", value=policy.draft_len)
    est = GaugeMetricFamily("tsengine:spec_decode_acceptance_estimate", "Running estimate of P(the first i+1 "
                            "drafts are accepted), by draft source and position i.", labels=["source", "position"])
    for source, acc in (("eagle3", policy.eagle), ("ngram", policy.lookup), ("pad", policy.pad)):
        for i, rate in enumerate(acc.rates()):
            est.add_metric([source, str(i)], rate)
    yield est
    trees = GaugeMetricFamily("tsengine:spec_decode_tree_tokens_estimate", "Running mean of tokens committed "
                              "per verify window, by tree shape (steps x topk x nodes).", labels=["shape"])
    for arm, mean in policy.tree_tokens.items():
        trees.add_metric([arm.name.split()[1]], mean.mean)
    yield trees
    cost = GaugeMetricFamily("tsengine:spec_decode_cost_model_seconds", "Fitted step-cost models (seconds per "
                             "unit): the target's forward, the head's extension and drafting, its catch-up over "
                             "rows kept while it did not draft, and prompt lookup with the decision.",
                             labels=["part", "term"])
    costs = policy.costs
    for part, model in (("target", costs.target), ("draft", costs.draft), ("catch_up", costs.catch_up),
                        ("overhead", costs.overhead)):
        for term, value in zip(model.names, model.theta):
            cost.add_metric([part, term], value)
    yield cost
    refills = policy.refills.share.value
    yield GaugeMetricFamily("tsengine:spec_decode_refill_share", "Share of requests leaving the batch whose slot a "
                            "new request took within a second (decayed; -1: none left yet). Under one half, a batch "
                            "that started together is held to the margin over plain decoding.",
                            value=-1.0 if refills is None else refills)
    for name, records, what in (("step_seconds", costs.step_seconds, "The target's step"),
                                ("head_seconds", costs.head_seconds, "The head's drafting pass")):
        family = GaugeMetricFamily(f"tsengine:spec_decode_{name}", f"{what} as the policy prices it where the "
                                   "shape has a record of its own (mean or recent median, seconds), by arm and graph "
                                   "batch bucket: with the prediction ratios, why a plan was or was not chosen.",
                                   labels=["arm", "batch"])
        for (arm, bucket), record in sorted(list(records.items()), key=lambda kv: (kv[0][0].name, kv[0][1])):
            if record.value is not None:
                family.add_metric([arm.name, str(bucket)], record.value)
        yield family
    corr = GaugeMetricFamily("tsengine:spec_decode_prediction_ratio", "Tokens each kind of step delivered over "
                             "the tokens its prediction promised in the step's time (decayed sums), by kind and "
                             "batch bucket; the policy multiplies its predictions by it.", labels=["kind", "batch"])
    for (kind, bucket), ratio in sorted(policy.correction.ratio.items()):
        corr.add_metric([kind, str(bucket)], ratio)
    yield corr
    chosen = CounterMetricFamily("tsengine:spec_decode_policy_steps", "Steps run with each choice "
                                 "(plain, chain k, tree SxKxN).", labels=["choice"])
    for name, n in sorted(list(policy.chosen.items())):  # a copy: the engine thread adds keys
        chosen.add_metric([name], n)
    yield chosen
    sources = CounterMetricFamily("tsengine:spec_decode_policy_requests", "Request-steps by draft source "
                                  "(eagle3, ngram, plain).", labels=["source"])
    for name, n in sorted(list(policy.drafted_by.items())):
        sources.add_metric([name], n)
    yield sources


class PrometheusMetrics:
    """One registry per server (not the global default), so several apps in one process do not collide."""

    def __init__(self, engine):
        self.registry = r = CollectorRegistry()
        r.register(_EngineCollector(engine))
        self.success = Counter("tsengine:request_success", "Finished choices.", ["finished_reason"], registry=r)
        self.prompt_tokens = Counter("tsengine:prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generation_tokens = Counter("tsengine:generation_tokens", "Tokens generated.", registry=r)
        self.ttft = Histogram("tsengine:time_to_first_token_seconds", "Arrival to first token.", registry=r,
                              buckets=(.001, .005, .01, .02, .04, .06, .08, .1, .25, .5, .75, 1, 2.5, 5, 7.5, 10,
                                       20, 40, 80, 160, 640))
        self.itl = Histogram("tsengine:inter_token_latency_seconds",
                             "Time between two outputs of a request (one output may carry several accepted "
                             "tokens).", registry=r,
                             buckets=(.01, .025, .05, .075, .1, .15, .2, .3, .4, .5, .75, 1, 2.5, 5, 7.5, 10, 20))
