"""A benchmark's command line: a bad value stops it in one line before anything is
built or measured, and --quick shrinks only the sizes the command line did not give."""

import argparse

import pytest

from bench import common
from bench.__main__ import main

BAD = [
    ("decode", ["--batch", "abc"], "--batch: takes whole numbers >= 1"),
    ("decode", ["--batch", "-1"], "--batch: takes whole numbers >= 1"),
    ("decode", ["--new", "0"], "--new: takes a whole number >= 1"),
    ("decode", ["--repeat", "0"], "--repeat"),
    ("decode", ["--plan", "foo"], "--plan: 'foo' is not shape:dtype:B1,B2"),
    ("decode", ["--methods", "raw,fast"], "--methods: 'fast' is not one of"),
    ("cache-kinds", ["--shapes", "foo"], "--shapes: 'foo' is not one of"),
    ("cache-kinds", ["--rounds", "0"], "--rounds"),
    ("cache-kinds", ["--kv-budget", "lots"], "--kv-budget: takes a size"),
    ("cache-kinds", ["--quick", "--kv-new", "600"], "--kv-new: takes fewer tokens"),
    ("kv-attention", ["--shapes", "foo"], "--shapes"),
    ("kv-attention", ["--bits", "3"], "--bits"),
    ("recurrent-step", ["--shapes", "llama-1b"], "--shapes"),
    ("speculate", ["--sets", "foo"], "--sets"),
    ("speculate-draft", ["--batch", "0"], "--batch"),
    ("mixed", ["--waves", "0"], "--waves"),
    ("mixed", ["--min", "20", "--max", "10"], "--min: takes a prompt length"),
    ("mixed", ["--rows", "2", "--waves", "4"], "--waves: takes at most --rows"),
    ("mixed", ["--max-batch", "0"], "--max-batch"),
    ("remote", ["--passes", "0"], "--passes"),
    ("token-probs", ["--batch", "8,x"], "--batch"),
    ("verify-cost", ["--dims", "576by1536"], "--dims: takes d x f shapes"),
    ("verify-cost", ["--skip", "20"], "--skip"),
    ("first-token", ["--runs", "0"], "--runs"),
    ("first-token", ["--shape", "llama1b", "--size", "quick"], "--size: takes a hybrid shape"),
    ("decode", ["--quick", "--hardware", "My H200!"], "--hardware: takes lower-case"),
    ("decode", ["--quick", "--out", "/proc/no/such/folder"], "--out: cannot make folder"),
]


@pytest.mark.parametrize("name,argv,says", BAD, ids=[f"{n} {' '.join(a)}" for n, a, _ in BAD])
def test_a_bad_option_stops_the_run_in_one_line(name, argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        main([name] + argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    assert err[-1].startswith(f"python -m bench {name}: error: argument "), err
    assert says in err[-1], err[-1]


def test_an_out_folder_is_made_before_the_run(tmp_path):
    ap = common.parser("x\n", "p")
    common.add_output_args(ap)
    where = tmp_path / "a" / "b"
    args = ap.parse_args(["--out", str(where)])
    assert where.is_dir() and args.out == where


def test_quick_keeps_what_the_command_line_gave():
    ap = common.parser("x\n", "p")
    ap.add_argument("--batch", type=common.counts, default=[1, 8])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--new", type=common.count, default=128)
    ap.add_argument("--quick", action="store_true")
    for argv in (["--quick", "--dtype", "float16", "--batch", "3"],
                 ["--quick", "--dtype=float16", "--batch=3"]):
        args = ap.parse_args(argv)
        common.quick(ap, args, argv, batch=[1, 4], dtype="float32", new=16)
        assert (args.batch, args.dtype, args.new) == ([3], "float16", 16)


def test_options_are_spelled_whole():
    """An abbreviation would slip past `quick`'s reading of the command line."""
    ap = common.parser("x\n", "p")
    ap.add_argument("--batch", type=common.counts, default=[1, 8])
    with pytest.raises(SystemExit):
        ap.parse_args(["--bat", "3"])


def test_a_list_type_names_what_it_takes():
    with pytest.raises(argparse.ArgumentTypeError, match="comma-separated"):
        common.counts("1,,8")
    assert common.counts("1,8,32") == [1, 8, 32]
    assert common.names(["a", "b"])("b,a") == ["b", "a"]
