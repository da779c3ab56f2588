"""scripts/reproduce.py end to end: SSGD, SSD-SGD and SSD-SGD + top-k with the shipped CIFAR-10 configs,
one short epoch each, on a tiny CIFAR-10 set in the published binary format."""

import pytest


def test_hosts_without_an_interface_are_refused_where_the_configs_name_none(tmp_path, capsys):
    from scripts.reproduce import common_sets, parse_args
    hosts = tmp_path / "hosts"
    hosts.write_text("h1\nh2\n")
    with pytest.raises(SystemExit) as stop:
        parse_args(["--suite", "fmnist", "--hostfile", str(hosts), "--out", str(tmp_path / "o")])
    assert stop.value.code == 2 and "--interface: required with --hostfile" in capsys.readouterr().err
    args, out = parse_args(["--suite", "fmnist", "--hostfile", str(hosts), "--interface", "eth1",
                            "--out", str(tmp_path / "o")])
    assert "cluster.interface=eth1" in common_sets(args, out)
    with pytest.raises(SystemExit):
        parse_args(["--suite", "fmnist", "--interface", "eth1", "--out", str(tmp_path / "o")])


def test_the_default_results_folder_is_outside_the_tracked_tree(tmp_path, monkeypatch):
    from scripts.reproduce import parse_args
    monkeypatch.chdir(tmp_path)
    _, out = parse_args(["--suite", "fmnist"])
    assert out == str(tmp_path / "runs" / "reproduce_fmnist")


def test_table_gives_no_spread_for_one_seed_and_says_what_each_column_is():
    from scripts import reproduce

    def row(variant, seed, acc):
        return {"variant": variant, "seed": seed, "rc": 0, "eval_set": "test", "final_acc": acc,
                "images_per_sec": 10.0 + seed, "push_bytes_per_step": 4, "pull_bytes_per_step": 8, "wall_seconds": 5}
    text = reproduce.table([row("SSGD", 0, 0.25), row("SSD-SGD", 0, 0.5), row("SSD-SGD", 1, 0.7)])
    lines = text.splitlines()
    assert lines[2].startswith("| SSGD | 0.2500 (one seed) | 0.2500 | 10.0 |")
    assert lines[3].startswith("| SSD-SGD | 0.6000 ± 0.1414 | 0.5000 0.7000 | 10.5 |")
    assert "Accuracy: mean ± sd over seeds; images/s, bytes and wall seconds: medians over seeds" in text
