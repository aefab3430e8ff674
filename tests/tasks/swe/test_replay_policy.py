"""The replay policy's parts, with the real chat tokenizer: its script per job, the turn it is on as read
from the prompt, and what ``raas run --policy replay`` refuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raas.cli.run import replay_inputs
from raas.errors import RaasError
from raas.llm.scripted import CompletionRequest
from raas.llm.tokenizer import ChatTokenizer
from raas.tasks.datasets import load_file
from raas.tasks.swe.replay import REPLAY_CONTEXT, replay_book, replay_context

pytestmark = pytest.mark.unit

DATA = Path(__file__).parent / "data" / "swebench_records.jsonl"
PATCH = "diff --git a/a.py b/a.py\n--- a/a.py\n+++ b/a.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n"


def request(tok: ChatTokenizer, system: str, assistant_turns: int) -> CompletionRequest:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "fix it"}]
    for _ in range(assistant_turns):
        messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "tool output"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    return CompletionRequest(prompt_ids=ids, prompt_text=None, max_tokens=64, body={}, index=0)


def test_each_job_gets_its_patch_then_submit(tokenizer: ChatTokenizer) -> None:
    tok = tokenizer
    rows = load_file(DATA)[:2]
    book, params = replay_book(tok, {rows[0]["instance_id"]: PATCH}, rows)
    first, second = params[0]["system_prompt"], params[1]["system_prompt"]
    assert first != second and "[script:" in first
    turn0 = tok.decode(book(request(tok, first, 0)).token_ids)
    assert "git apply /tmp/fix.patch" in turn0 and "+x = 2" in turn0 and '"name": "bash"' in turn0
    assert '"name": "submit"' in tok.decode(book(request(tok, first, 1)).token_ids)
    # An instance without a patch submits at once (graded empty_patch).
    assert '"name": "submit"' in tok.decode(book(request(tok, second, 0)).token_ids)
    with pytest.raises(RuntimeError):
        book(request(tok, "no marker here", 0))


@pytest.mark.parametrize(
    ("policy", "patches", "server", "message"),
    [
        ("replay", None, None, "needs --patches"),
        ("replay", "preds", "http://127.0.0.1:8008", "drop --server"),
        ("model", "preds", None, "--patches is for --policy replay"),
        ("greedy", None, None, "--policy must be"),
    ],
)
def test_replay_inputs_refuse_what_cannot_work(
    tmp_path: Path, policy: str, patches: str | None, server: str | None, message: str
) -> None:
    preds = tmp_path / "preds.jsonl"
    preds.write_text(json.dumps({"instance_id": "x", "model_patch": PATCH}) + "\n")
    with pytest.raises(RaasError) as err:
        replay_inputs(policy, preds if patches else None, load_file(DATA), server=server, llm=None)
    assert err.value.kind == "bad_request" and message in err.value.message


def test_replay_inputs_read_predictions_and_refuse_non_swe_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = load_file(DATA)
    preds = tmp_path / "preds.jsonl"
    preds.write_text(json.dumps({"instance_id": rows[0]["instance_id"], "model_patch": PATCH}) + "\n")
    assert replay_inputs("replay", preds, rows[:1], server=None, llm=None) == {rows[0]["instance_id"]: PATCH}
    assert "no prediction" not in capsys.readouterr().err
    assert replay_inputs("replay", preds, rows[:3], server=None, llm=None) == {rows[0]["instance_id"]: PATCH}
    said = " ".join(capsys.readouterr().err.split())
    assert "2 of 3 instances have no prediction in" in said
    assert rows[1]["instance_id"] in said and rows[2]["instance_id"] in said
    assert replay_inputs("model", None, rows, server=None, llm=None) is None
    math = [{"data_source": "math", "problem": "1+1", "answer": "2", "instance_id": "m"}]
    with pytest.raises(RaasError, match="not SWE records: m"):
        replay_inputs("replay", preds, math, server=None, llm=None)
    preds.write_text(json.dumps({"instance_id": rows[0]["instance_id"], "model_patch": "words"}) + "\n")
    with pytest.raises(RaasError, match="not a unified diff"):
        replay_inputs("replay", preds, rows, server=None, llm=None)


def test_budgets_fit_a_long_patch(tokenizer: ChatTokenizer) -> None:
    """A replayed patch is one turn however long: the job's budgets are sized so it is applied and the
    rollout still ends with submit (not cut by ``context_budget``)."""
    tok = tokenizer
    rows = load_file(DATA)[:2]
    added = "".join(f"+line {i} of a long note\n" for i in range(1500))
    long = (
        PATCH
        + f"diff --git a/N.md b/N.md\nnew file mode 100644\n--- /dev/null\n+++ b/N.md\n@@ -0,0 +1,1500 @@\n{added}"
    )
    book, params = replay_book(tok, {rows[0]["instance_id"]: long}, rows)
    turn0 = len(book(request(tok, params[0]["system_prompt"], 0)).token_ids)
    assert turn0 > 10_000
    assert params[0]["max_tokens_per_turn"] >= turn0
    assert params[0]["context_budget"] >= REPLAY_CONTEXT + turn0
    assert replay_context(params) == params[0]["context_budget"]
    assert params[1]["max_tokens_per_turn"] == 1024  # a short script keeps the usual per-turn budget
