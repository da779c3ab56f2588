"""The documentation matches the code and the repository: docs/config.md is what scripts/gen_config_doc.py
renders from SCHEMA today, every config and script the docs name exists, every results folder the README
cites exists and has a full manifest.json, results/ holds only folders the README or docs/ cite (each with a
manifest, no code), results/README.md is what scripts/results_index.py writes, and the README stays short."""
import glob
import json
import os
import re
import subprocess

from scripts import gen_config_doc, results_index
import pytest

from ssdsgd.config import SCHEMA

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULT_ROOTS = ("results",)
MAX_README_LINES = 250
MAX_PROSE_LINE = 120            # characters, outside tables and code blocks
SHORT_LINED_DOCS = ("README.md", "docs/results.md")
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


# results/README.md is left out: its commands are the manifests' records of how each folder was made, with the
# paths of their day (scripts/bench_network.py, since moved to bench/), not instructions.
@pytest.mark.parametrize("doc", ["README.md", "docs/design.md", "docs/results.md"])
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
    assert len(_read("README.md").splitlines()) <= MAX_README_LINES


def _long_prose_lines(text, limit=MAX_PROSE_LINE):
    """(line number, length) of the lines over `limit` characters outside fenced code blocks and tables."""
    long, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced and not line.lstrip().startswith("|") and len(line) > limit:
            long.append((number, len(line)))
    return long


@pytest.mark.parametrize("doc", SHORT_LINED_DOCS)
def test_prose_lines_are_short(doc):
    assert _long_prose_lines(_read(doc)) == [], (
        f"{doc}: (line, characters) over {MAX_PROSE_LINE} outside tables and code")


def test_the_line_test_sees_a_long_line():
    assert _long_prose_lines("x" * 121 + "\n| " + "y" * 200 + " |\n```\n" + "z" * 200 + "\n```\n") == [(1, 121)]


def test_results_index_is_what_the_script_writes():
    assert _read("results/README.md") == results_index.render(ROOT), (
        "results/README.md differs from what scripts/results_index.py writes; run python scripts/results_index.py")


def test_every_results_folder_is_cited_and_has_a_manifest():
    cited = results_index.citations(ROOT)
    problems = []
    for name in results_index.folders(ROOT):
        if name not in cited:
            problems.append(f"results/{name}: cited by neither README.md nor docs/*.md (git rm -r it, git keeps it)")
        if not os.path.isfile(os.path.join(ROOT, "results", name, "manifest.json")):
            problems.append(f"results/{name}: no manifest.json")
    dangling = sorted(f"results/{name}" for name in cited
                      if not os.path.isdir(os.path.join(ROOT, "results", name)))
    assert problems == [] and dangling == [], (problems, f"cited but missing: {dangling}")


def test_results_hold_no_code():
    code = [os.path.relpath(os.path.join(d, f), ROOT) for d, _, files in os.walk(os.path.join(ROOT, "results"))
            for f in files if f.endswith((".py", ".diff", ".patch"))]
    assert code == [], f"results/ holds evidence, not code: {code}"


def test_one_results_root():
    try:
        tracked = subprocess.run(["git", "ls-files", "bench_results"], cwd=ROOT, capture_output=True, text=True,
                                 check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    assert tracked == [], "results/ is the one results root: move what is still cited there"
