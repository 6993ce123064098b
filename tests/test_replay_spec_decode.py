"""``kvcache replay --draft-tokens``: speculation loses no prefix hit (issue 14, "Done when").

The workloads here share prefixes (system prompts, documents, earlier turns) and run many
requests at once (``max_inflight`` 32). Why the figures agree, and when they may not
(pool pressure, workloads without causality), is in docs/replay.md, "Speculative decoding".
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvcache.replay import DRAFT_ACCEPTANCE, ReplayConfig, replay
from kvcache.workload import Request, synthetic_workload


@pytest.fixture(scope="module")
def chat():
    w = synthetic_workload(120, seed=0)
    assert sum(r.follows is not None for r in w) > 30  # later turns of conversations
    return w


def _hits(s):
    return s.device_hit_tokens, s.external_hit_tokens, s.lost_hit_tokens


@pytest.mark.parametrize("backend", ["kvfast", "kvref"])
@pytest.mark.parametrize("drafts,acceptance", [(4, "random"), (4, "all"), (1, "random"), (4, "none")])
def test_speculative_replay_hits_equal_plain_decoding(chat, backend, drafts, acceptance):
    plain = replay(chat, ReplayConfig(backend=backend))
    spec = replay(chat, ReplayConfig(backend=backend, draft_tokens=drafts, draft_acceptance=acceptance))
    assert plain.hit_rate > 0.8
    assert _hits(spec) == _hits(plain)
    assert spec.hit_rate == plain.hit_rate
    if acceptance != "none":
        assert spec.steps < plain.steps  # several tokens per decode forward: a different schedule
    else:
        assert spec.steps == plain.steps


def test_without_causality_faster_decodes_lose_hits_in_flight(chat):
    """The failure the causality rule removes: a later turn admitted while the turn whose answer it
    holds is still decoding loses the answer's pages (``in_flight``), and faster decodes change how
    many. The schedule-preserving mode shows the cache itself loses nothing."""
    free = [dataclasses.replace(r, follows=None) for r in chat]
    plain = replay(free, ReplayConfig())
    spec = replay(free, ReplayConfig(draft_tokens=4))
    assert plain.lost_hit_tokens.get("in_flight", 0) > 0
    assert spec.hit_tokens != plain.hit_tokens  # timing only:
    same = replay(free, ReplayConfig(draft_tokens=4, draft_acceptance="none"))
    assert _hits(same) == _hits(plain) and same.steps == plain.steps


def test_causality_waits_for_the_turn_it_follows():
    """B holds A's answer: it is admitted only after A finished, so it reuses A's prompt and answer."""
    ps = 4
    a_prompt = np.arange(1, 13, dtype=np.int32)
    a_out = np.arange(100, 109, dtype=np.int32)
    b_prompt = np.concatenate([a_prompt, a_out, np.array([7, 7, 7], np.int32)])
    out = np.array([5, 6], np.int32)
    a = Request("a", a_prompt, a_out, 0.0)
    b = Request("b", b_prompt, out, 1.0, follows="a")
    for kw in ({}, dict(draft_tokens=3)):
        s = replay([a, b], ReplayConfig(page_size=ps, num_blocks=64, **kw))
        assert s.hit_tokens == s.ceiling_hit_tokens == (len(a_prompt) + len(a_out) - 1) // ps * ps
        loose = replay([a, dataclasses.replace(b, follows=None)], ReplayConfig(page_size=ps, num_blocks=64, **kw))
        assert loose.hit_tokens < s.hit_tokens and loose.lost_hit_tokens.get("in_flight", 0) > 0
    # a follows naming a request the workload does not hold finished before the replay
    assert replay([dataclasses.replace(b, follows="gone")], ReplayConfig(page_size=ps)).requests == 1
    with pytest.raises(ValueError, match="follows 'b', which arrives at or after it"):
        replay([dataclasses.replace(a, follows="b"), b], ReplayConfig(page_size=ps))
    with pytest.raises(ValueError, match="follows 'a', which arrives at or after it"):
        replay([dataclasses.replace(a, follows="a")], ReplayConfig(page_size=ps))


def test_verified_drafts_count_in_the_token_budget():
    """vLLM's rule: a decode that verifies k drafts schedules 1 + k tokens; with less budget left its
    drafts are cut (and it still makes progress)."""
    prompt = np.arange(1, 41, dtype=np.int32)
    r = Request("r", prompt, np.arange(50, 80, dtype=np.int32), 0.0)
    s = replay([r], ReplayConfig(page_size=4, num_blocks=64, draft_tokens=4, draft_acceptance="none"))
    assert set(s.series["batch_tokens"][1:]) == {1}  # the diagnostic mode charges the drafts nothing
    s = replay([r], ReplayConfig(page_size=4, num_blocks=64, draft_tokens=4, draft_acceptance="all"))
    assert s.series["batch_tokens"][0] == 40 and set(s.series["batch_tokens"][1:]) == {5}
    assert s.steps == 1 + 6  # 30 tokens: the prefill's, then 29 in forwards of 5 (4 drafts + bonus)
    tight = replay([r], ReplayConfig(page_size=4, num_blocks=64, max_batch_tokens=40, draft_tokens=4,
                                     draft_acceptance="all"))
    assert max(tight.series["batch_tokens"]) <= 40
    two = replay([r, dataclasses.replace(r, request_id="q")],
                 ReplayConfig(page_size=4, num_blocks=64, max_batch_tokens=7, draft_tokens=4,
                              draft_acceptance="all"))
    assert max(two.series["batch_tokens"]) <= 7 and two.output_tokens == 60
    both = [t for t, n in zip(two.series["batch_tokens"], two.series["batch_requests"]) if n == 2]
    assert both and set(both) == {7}  # 5 + 2: the second decode's drafts were cut to what was left


def test_draft_acceptance_is_checked():
    assert DRAFT_ACCEPTANCE == ("random", "none", "all")
    with pytest.raises(ValueError, match="draft_acceptance='some', must be one of"):
        ReplayConfig(draft_acceptance="some")


def test_cli_draft_options(capsys):
    from kvcache.cli import main

    tiny = ["--num-requests", "12", "--num-layers", "1", "--kv-heads", "1", "--head-dim", "2", "--no-progress"]
    assert main(["replay", *tiny]) == 0
    plain = capsys.readouterr().out
    for extra in (["--draft-tokens", "3"], ["--draft-tokens", "3", "--draft-acceptance", "none"],
                  ["--draft-tokens", "2", "--draft-acceptance", "all"]):
        assert main(["replay", *tiny, *extra]) == 0
        out = capsys.readouterr().out
        line = next(x for x in out.splitlines() if "prefix hit rate" in x)
        assert line in plain  # the built-in workload: the same hit rate
    assert main(["replay", *tiny, "--draft-acceptance", "all"]) == 2
    assert "--draft-acceptance=all needs --draft-tokens > 0" in capsys.readouterr().err
