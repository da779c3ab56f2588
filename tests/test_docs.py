"""The documentation matches the code and the repository: docs/config.md is what scripts/gen_config_doc.py
renders from SCHEMA today, every config and script the README names exists, every results folder it
cites exists and has a manifest.json, and results/README.md indexes every committed results folder."""
import glob
import json
import os
import re
import subprocess

from scripts import gen_config_doc
import pytest

from ssdsgd.config import SCHEMA

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT_ROOTS = ("results",)
# Paths the README shows as examples of files a user would add; they are not meant to exist.
EXAMPLE_PATHS = {"ssdsgd/compression/maxk.py", "ssdsgd/algorithms/toy.py"}   # the extending examples


def _read(rel):
    with open(os.path.join(ROOT, rel)) as f:
        return f.read()


def test_config_doc_matches_schema():
    assert gen_config_doc.render() == _read("docs/config.md"), (
        "docs/config.md differs from ssdsgd/schema.py's SCHEMA; run python scripts/gen_config_doc.py")


def test_every_key_has_one_description():
    leaves = dict(gen_config_doc._rows(SCHEMA, ""))
    missing = [k for k, f in leaves.items() if not f.doc and k not in gen_config_doc.NOTES]
    both = [k for k, f in leaves.items() if f.doc and k in gen_config_doc.NOTES]
    stale = [k for k in gen_config_doc.NOTES if k not in leaves]
    assert missing == [], f"describe these keys (doc= in SCHEMA): {missing}"
    assert both == [], f"SCHEMA documents these now; remove them from NOTES in scripts/gen_config_doc.py: {both}"
    assert stale == [], f"NOTES in scripts/gen_config_doc.py names keys SCHEMA does not have: {stale}"


def test_check_mode(tmp_path, capsys):
    out = tmp_path / "config.md"
    assert gen_config_doc.main(["--check", "--out", str(out)]) == 1      # missing
    assert gen_config_doc.main(["--out", str(out)]) == 0
    assert gen_config_doc.main(["--check", "--out", str(out)]) == 0
    out.write_text(out.read_text() + "edited by hand\n")
    assert gen_config_doc.main(["--check", "--out", str(out)]) == 1
    assert "gen_config_doc.py" in capsys.readouterr().err


def _expand(path):
    """`a_{x,y}.yaml` -> [a_x.yaml, a_y.yaml] (one brace group, as the README writes families of configs)."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [path[:m.start()] + alt + path[m.end():] for alt in m.group(1).split(",")]


def _repo_paths(text):
    pattern = r"(?<![\w/.-])((?:configs|scripts|bench|ssdsgd|tests|docs|launch)/[\w./{},*-]+\.(?:yaml|py|md|example))"
    return sorted(set(re.findall(pattern, text)))


@pytest.mark.parametrize("doc", ["README.md", "docs/design.md", "results/README.md"])
def test_named_files_exist(doc):
    missing = []
    for path in _repo_paths(_read(doc)):
        if path in EXAMPLE_PATHS:
            continue
        for one in _expand(path):
            if not glob.glob(os.path.join(ROOT, one)):
                missing.append(one)
    assert missing == [], f"{doc} names files that do not exist: {missing}"


def _cited_result_folders(text):
    folders = set()
    for root in RESULT_ROOTS:
        for m in re.finditer(rf"(?<![\w/.-]){root}/([\w.-]+)", text):
            name = m.group(1)
            rest = text[m.end():m.end() + 1]
            if name.endswith(".md") or rest == "<":       # results/README.md; results/reproduce_<suite>
                continue
            folders.add(f"{root}/{name}")
    return sorted(folders)


def test_readme_results_folders_have_manifests():
    cited = _cited_result_folders(_read("README.md"))
    assert cited, "the README cites no results folder"
    problems = []
    for folder in cited:
        path = os.path.join(ROOT, folder, "manifest.json")
        if not os.path.isdir(os.path.join(ROOT, folder)):
            problems.append(f"{folder}: no such folder")
            continue
        try:
            with open(path) as f:
                manifest = json.load(f)
        except (OSError, ValueError) as err:
            problems.append(f"{folder}: {err}")
            continue
        for key in ("command", "configs", "machine", "date"):
            if key not in manifest:
                problems.append(f"{folder}: manifest.json has no {key!r}")
        if not (manifest.get("commit") or manifest.get("commit_note")):
            problems.append(f"{folder}: manifest.json names no commit (or why not)")
    assert problems == []


def test_readme_stays_short():
    assert len(_read("README.md").splitlines()) <= 450


def test_results_index_lists_every_committed_folder():
    try:
        tracked = subprocess.run(["git", "ls-files", *RESULT_ROOTS], cwd=ROOT, capture_output=True, text=True,
                                 check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    folders = {"/".join(p.split("/")[:2]) for p in tracked if p.count("/") >= 2}
    index = _read("results/README.md")
    unlisted = sorted(f for f in folders if f"`{f}/`" not in index)
    assert unlisted == [], f"add these folders to results/README.md: {unlisted}"
