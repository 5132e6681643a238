"""The lm-eval task of benchmarks/lm_eval_gateway.py without lm-eval: the committed questions are
what the generator makes, each question's marked answer is the right one, the task YAML reads
the fields the records have from a path that exists, and the script's --help runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from benchmarks.lm_eval_task import questions

ROOT = Path(__file__).resolve().parents[1]
TASK_YAML = ROOT / "benchmarks" / "lm_eval_task" / "pdserve_mc.yaml"


def records() -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(line) for line in questions.DATA_FILE.read_text().splitlines()]


def test_committed_questions_are_the_generators() -> None:
    assert questions.DATA_FILE.read_text() == questions.to_jsonl(questions.make_questions())


def test_each_question_marks_its_right_answer_among_distinct_choices() -> None:
    made = records()
    assert 100 <= len(made) <= 200
    answers = {  # question -> its right answer, from the tables
        f"Question: {text.format(key)}\nAnswer:": value
        for table, text in questions.TABLES
        for key, value in table.items()
    }
    for record in made:
        choices, text = record["choices"], record["question"]
        assert len(set(choices)) == questions.NUM_CHOICES, record
        assert not any(c.startswith(" ") for c in choices), record  # lm-eval adds the space
        right = choices[record["answer"]]
        if " plus " in text:
            a, b = text.removeprefix("Question: What is ").split("?")[0].split(" plus ")
            assert right == str(int(a) + int(b)), record
        elif "comes" not in text:
            assert answers[text] == right, record
    assert {r["answer"] for r in made} == set(range(questions.NUM_CHOICES))


def test_task_yaml_reads_the_records_fields_from_the_data_file() -> None:
    task = yaml.safe_load(TASK_YAML.read_text())
    assert task["output_type"] == "multiple_choice"
    data_file = ROOT / task["dataset_kwargs"]["data_files"][task["test_split"]]
    assert data_file == questions.DATA_FILE
    record = records()[0]
    assert task["doc_to_text"] == "{{question}}" and "question" in record
    assert task["doc_to_choice"] in record and task["doc_to_target"] in record
    assert {m["metric"] for m in task["metric_list"]} == {"acc", "acc_norm"}


def test_script_help_runs_without_lm_eval() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.lm_eval_gateway", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "--limit" in done.stdout and "--disaggregation" in done.stdout
