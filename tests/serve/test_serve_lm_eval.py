"""lm-evaluation-harness's `local-completions` model against `lmkit serve` scores a task as lm-eval's own `hf` model
(HFLM) scores it in process on the same folder: loglikelihood (multiple choice, echo logprobs) and generation
(generate_until with stop sequences), with the tokenizer found through the server's /tokenizer_info and /tokenize."""
import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("transformers")
lm_eval = pytest.importorskip("lm_eval")
from serving_folders import RunningServer, make_folder  # noqa: E402

ROWS = [("The quick brown", ["fox", "dog", "café"], 0), ("def f(x):", ["return x", "pass", "yield"], 1),
        ("hello", [" world", " there", "!"], 2), ("naïve", [" café", " 東京", " test"], 0),
        ("stop here", [" STOP", " there", " now"], 1), ("The lazy", [" dog", " fox", " cat"], 2)]


def _tasks(folder):
    data = folder / "rows.jsonl"
    data.write_text("".join(json.dumps({"q": q, "choices": c, "label": a}) + "\n" for q, c, a in ROWS),
                    encoding="utf-8")
    common = {"dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}}, "test_split": "test",
              "doc_to_text": "{{q}}"}
    mc = {**common, "task": "lmkit_serve_mc", "output_type": "multiple_choice", "doc_to_choice": "{{choices}}",
          "doc_to_target": "{{label}}", "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}]}
    gen = {**common, "task": "lmkit_serve_gen", "output_type": "generate_until", "doc_to_target": "{{choices[0]}}",
           "generation_kwargs": {"until": ["zq", "\n\n\n"], "max_gen_toks": 12, "do_sample": False},
           "metric_list": [{"metric": "exact_match"}]}
    import yaml

    for task in (mc, gen):
        (folder / f"{task['task']}.yaml").write_text(yaml.safe_dump(task), encoding="utf-8")
    return folder


def _scores(results):
    return {task: {k: v for k, v in metrics.items() if k.endswith(",none") and "stderr" not in k}
            for task, metrics in results["results"].items()}


@pytest.mark.slow
def test_local_completions_against_the_server_scores_as_hflm(tmp_path):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    folder = make_folder(tmp_path / "model", "gpt2", n_positions=128)
    tasks = _tasks(tmp_path)
    manager = TaskManager(include_path=str(tasks))
    names = ["lmkit_serve_mc", "lmkit_serve_gen"]
    reference = simple_evaluate(model="hf", model_args=f"pretrained={folder},dtype=float32", tasks=names,
                                task_manager=manager, batch_size=1, device="cpu")
    with RunningServer(folder) as server:
        served = simple_evaluate(
            model="local-completions", tasks=names, task_manager=manager,
            model_args=f"model=m,base_url={server.url}/v1/completions,num_concurrent=4,max_retries=1,"
                       f"max_length=128,max_gen_toks=12")
    assert _scores(served) == _scores(reference)
    assert any(s["resps"][0][0] for s in served["samples"]["lmkit_serve_gen"])  # text was generated
    for name in names:  # and request by request: the same log-likelihoods (and greedy flags), the same generations
        ours, theirs = served["samples"][name], reference["samples"][name]
        assert len(ours) == len(theirs) == len(ROWS)
        for a, b in zip(sorted(ours, key=lambda s: s["doc_id"]), sorted(theirs, key=lambda s: s["doc_id"])):
            for x, y in zip(a["resps"], b["resps"]):
                if name.endswith("mc"):
                    assert x[0][0] == pytest.approx(y[0][0], abs=1e-4) and x[0][1] == y[0][1]
                else:
                    assert x == y
