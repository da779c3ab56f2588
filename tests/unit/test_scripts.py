"""The small user tools: scripts/demo.py and scripts/compare.py."""
import json

import pytest
from scripts.results_io import printed_run_folder


def test_printed_run_folder_is_the_front_ends_line_under_the_jobs_cwd():
    assert printed_run_folder("x\nrun folder: /a/b/c\n[worker 1] run folder: /d\n") == "/a/b/c"
    assert printed_run_folder("run folder: runs/n/1\n", cwd="/r") == "/r/runs/n/1"
    assert printed_run_folder("[worker 1 (rank 0)] run folder: /d\n") is None


def _summary(name, acc):
    return {"name": name, "algorithm": "ssgd", "compression": "none", "eval_set": "test", "final_test_acc": acc,
            "images_per_sec": 100.0, "bytes_per_step": {"push": 10, "pull": 10}, "max_staleness": 0}


def _run(home, stamp, acc=None):
    """A run folder home/stamp: finished (summary.json) when acc is given, else only started."""
    folder = home / stamp
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text("name: x\n")
    if acc is not None:
        (folder / "summary.json").write_text(json.dumps(_summary(home.name, acc)))
    return folder


def _compare(capsys, *paths):
    from scripts import compare
    rc = compare.main([str(p) for p in paths])
    out, err = capsys.readouterr()
    return rc, out, err


def test_compare_takes_run_folders_and_a_names_folder_stands_for_its_latest_run(tmp_path, capsys):
    run = _run(tmp_path / "a", "20260101-000000", 0.5)
    linked = tmp_path / "b"
    _run(linked, "20260101-000000", 0.25)
    _run(linked, "20260102-000000", 0.75)
    (linked / "latest").symlink_to("20260101-000000")          # latest wins over the newer stamp
    stamped = tmp_path / "c"                                    # no link: the newest stamp, -10 after -9
    _run(stamped, "20260101-000000-9", 0.125)
    _run(stamped, "20260101-000000-10", 0.875)
    rc, out, err = _compare(capsys, run, linked, stamped)
    assert rc == 0 and err == ""
    accs = [line.split()[3] for line in out.splitlines()[2:]]
    assert accs == ["0.5000", "0.2500", "0.8750"]


def test_compare_never_shows_a_validation_accuracy_as_a_test_one(tmp_path, capsys):
    tested = _run(tmp_path / "tested", "20260101-000000", 0.25)
    validated = tmp_path / "validated" / "20260101-000000"
    validated.mkdir(parents=True)
    (validated / "summary.json").write_text(json.dumps(dict(_summary("validated", 0.0), eval_set="validation",
                                                            final_val_acc=0.75)))
    rc, out, _ = _compare(capsys, tested)
    assert rc == 0 and out.splitlines()[0].split()[3:5] == ["test", "acc"]
    rc, out, _ = _compare(capsys, validated)
    assert rc == 0 and out.splitlines()[0].split()[3:5] == ["val", "acc"]
    rc, out, _ = _compare(capsys, tested, validated)
    assert rc == 0 and out.splitlines()[0].split()[3:5] == ["final", "acc"]
    assert [line.split()[3:5] for line in out.splitlines()[2:]] == [["0.2500", "test"], ["0.7500", "val"]]


@pytest.mark.parametrize("case, expected", [
    ("missing", "does not exist"),
    ("empty", "is neither a run folder (no summary.json, config.yaml or metrics.jsonl) nor a folder of runs"),
    ("unfinished", "has no summary.json: the run did not finish, or is still running"),
    ("unfinished_latest", "(latest run {tmp}/name/20260101-000000) has no summary.json"),
    ("broken_latest", "latest points to 'gone', which is not a folder"),
])
def test_compare_says_in_one_line_what_it_expected(tmp_path, capsys, case, expected):
    path = tmp_path / "name"
    if case == "empty":
        path.mkdir()
    elif case == "unfinished":
        path = _run(tmp_path / "name", "20260101-000000")
    elif case == "unfinished_latest":
        _run(path, "20260101-000000")
        (path / "latest").symlink_to("20260101-000000")
    elif case == "broken_latest":
        path.mkdir()
        (path / "latest").symlink_to("gone")
    rc, out, err = _compare(capsys, path)
    assert rc == 1 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and expected.format(tmp=tmp_path) in err, err


def test_keep_done_refuses_to_mix_jobs_made_with_other_settings(tmp_path):
    from scripts.results_io import settings_problem
    assert settings_problem(str(tmp_path), ["train.epochs=2"]) is None            # nothing written yet
    (tmp_path / "manifest.json").write_text(json.dumps({"command": ["x"]}))
    assert settings_problem(str(tmp_path), ["train.epochs=2"]) is None            # an older folder: taken as it is
    (tmp_path / "manifest.json").write_text(json.dumps({"settings": ["train.epochs=2"]}))
    assert settings_problem(str(tmp_path), ["train.epochs=2"]) is None
    problem = settings_problem(str(tmp_path), ["train.epochs=3"])
    assert problem.startswith(f"--keep-done: the finished jobs in {tmp_path} were made with ['train.epochs=2']")
    assert "choose another --out" in problem
