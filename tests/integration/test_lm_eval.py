"""lm-evaluation-harness (installed from PyPI, tests/client_venv.py) scores `iterserve serve`
through its completions endpoint (`local-completions`: loglikelihood through echo + logprobs, and
generate-until) on two small tasks written here to local files, and the same harness scores the
HF model in-process (transformers on the same GGUF); the scores, every choice's loglikelihood and
every generation must agree."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from contextlib import contextmanager

import pytest

from iterserve.engine.model.registry import resolve_model_path
from tests.client_venv import client_python
from tests.hf_fixture import reference_folder
from tests.server_fixture import running_server

pytestmark = [pytest.mark.slow, pytest.mark.beside_cluster, pytest.mark.timeout(1800)]

MC = [  # question, choices, answer
    ("The capital of France is", ["Paris", "London", "Berlin", "Madrid"], 0),
    ("Water freezes at a temperature of", ["0 degrees Celsius", "50 degrees Celsius", "90 degrees Celsius"], 0),
    ("The largest planet in the solar system is", ["Jupiter", "Mercury", "Mars", "Venus"], 0),
    ("A cat is a kind of", ["animal", "vegetable", "mineral"], 0),
    ("The opposite of hot is", ["cold", "loud", "tall", "green"], 0),
    ("Two plus two equals", ["four", "seven", "eleven"], 0),
    ("The sun rises in the", ["east", "west", "north", "south"], 0),
    ("Bees make", ["honey", "steel", "glass"], 0),
]
GEN = [  # prompt, answer
    ("Q: What is the capital of France?\nA:", "Paris"),
    ("Q: What colour is the sky on a clear day?\nA:", "Blue"),
    ("Q: How many legs does a spider have?\nA:", "Eight"),
    ("Q: What is 3 + 4?\nA:", "7"),
    ("Q: Who wrote Romeo and Juliet?\nA:", "William Shakespeare"),
]

DRIVER = textwrap.dedent("""
    import json, sys
    import lm_eval
    from lm_eval.tasks import TaskManager
    model, model_args, include, out = sys.argv[1:5]
    results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["iterserve_mc", "iterserve_gen"],
                                      task_manager=TaskManager(include_path=include), log_samples=True,
                                      batch_size=1, device="cpu")
    keep = {"results": results["results"], "samples": {
        task: [{"doc_id": s["doc_id"], "resps": s["resps"], "filtered_resps": s["filtered_resps"]} for s in samples]
        for task, samples in results["samples"].items()}}
    json.dump(keep, open(out, "w"), default=str)
""")


@pytest.fixture(scope="module")
def python():
    return client_python()


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm-eval-tasks")
    (folder / "mc.jsonl").write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                                             for q, c, a in MC))
    (folder / "gen.jsonl").write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in GEN))
    (folder / "mc.yaml").write_text(textwrap.dedent(f"""\
        task: iterserve_mc
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {folder / "mc.jsonl"}
        test_split: test
        output_type: multiple_choice
        doc_to_text: "{{{{question}}}}"
        doc_to_choice: "{{{{choices}}}}"
        doc_to_target: "{{{{answer}}}}"
        metric_list:
          - metric: acc
        """))
    (folder / "gen.yaml").write_text(textwrap.dedent(f"""\
        task: iterserve_gen
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {folder / "gen.jsonl"}
        test_split: test
        output_type: generate_until
        doc_to_text: "{{{{question}}}}"
        doc_to_target: "{{{{answer}}}}"
        generation_kwargs:
          until: ["\\n"]
          max_gen_toks: 12
          do_sample: false
          temperature: 0
        metric_list:
          - metric: exact_match
            ignore_case: true
            ignore_punctuation: true
        """))
    return folder


@pytest.fixture(scope="module")
def hf_reference():
    """transformers' conversion of the embedded GGUF as an ordinary model + tokenizer folder (cached
    across sessions, tests/hf_fixture.py): the harness's HF model, and the tokenizer it uses on both sides."""
    return reference_folder(resolve_model_path(None)[0])


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@contextmanager
def evaluation(python, model: str, model_args: str, tasks, out):
    """The harness in a process of its own; yields a call that waits for it and returns its results."""
    log = out.with_suffix(".log")
    with open(log, "wb") as output:
        run = subprocess.Popen([str(python), "-c", DRIVER, model, model_args, str(tasks), str(out)], env=_env(),
                               stdout=output, stderr=subprocess.STDOUT)

        def results() -> dict:
            assert run.wait(1500) == 0, log.read_text(errors="replace")[-4000:]
            return json.loads(out.read_text())

        try:
            yield results
        finally:
            if run.poll() is None:
                run.kill()
                run.wait()


def test_lm_eval_scores_the_server_as_it_scores_the_hf_model(python, tasks, hf_reference, tmp_path):
    # The HF eval (one core) runs while the server is scored (the server on the other core).
    with evaluation(python, "hf", f"pretrained={hf_reference},tokenizer={hf_reference},dtype=float32",
                    tasks, tmp_path / "hf.json") as hf_results:
        with running_server(["--max-model-len", "512", "--device", "cpu", "--dtype", "float32"], log_path=tmp_path / "server.log",
                            env={"OMP_NUM_THREADS": "1"}, ready_timeout=300) as server, \
             evaluation(python, "local-completions",
                        f"model=smollm2-135m,base_url={server.url}/v1/completions,tokenizer_backend=huggingface,"
                        f"tokenizer={hf_reference},num_concurrent=1,max_retries=1,max_length=512",
                        tasks, tmp_path / "served.json") as served_results:
            served = served_results()
        local = hf_results()
    print(json.dumps({"served": served["results"], "hf": local["results"]}, indent=1))
    for task, metric in (("iterserve_mc", "acc,none"), ("iterserve_gen", "exact_match,none")):
        assert served["results"][task][metric] == local["results"][task][metric], task
    assert served["results"]["iterserve_mc"]["acc,none"] >= 0.5  # a real score, not all-wrong plumbing
    by_doc = {s["doc_id"]: s for s in local["samples"]["iterserve_mc"]}
    for sample in served["samples"]["iterserve_mc"]:
        ours = [float(r[0][0]) for r in sample["resps"]]
        theirs = [float(r[0][0]) for r in by_doc[sample["doc_id"]]["resps"]]
        assert ours == pytest.approx(theirs, abs=2e-3), sample["doc_id"]
    generated = {s["doc_id"]: s["filtered_resps"] for s in served["samples"]["iterserve_gen"]}
    assert generated == {s["doc_id"]: s["filtered_resps"] for s in local["samples"]["iterserve_gen"]}
