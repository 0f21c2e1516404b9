"""llama.cpp's and llama-server's command-line names on k3-run (docs/run.md "llama.cpp
flags"): the aliases mean exactly what their k3 flags mean, ``-`` is standard input, a
positional prompt is --prompt, --ctx-size limits prompt and generation, the flags with no
meaning here are refused with the reason, and an unknown option's suggestions find the
k3 name."""

from __future__ import annotations

import json

import pytest

from k3_run.cli import main as run_main
from k3_run.llama import serve_address

from .hostile import check_refused, invoke
from .scripts import k3, k3_here


def _ids(p) -> list:
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)["generated_ids"]


def test_run_llama_aliases_give_the_k3_flags_tokens(tiny_dir):
    """Catches --temp or -s reaching anything but --temperature and --seed (a sampled run
    then gives other tokens), and a positional prompt that is not --prompt, with MODEL or
    with -m."""
    want = _ids(k3_here(tiny_dir, "--prompt", "Hello there", "--temperature", "0.9",
                        "--seed", 5, "-n", 6, "--json"))
    other_seed = _ids(k3_here(tiny_dir, "--prompt", "Hello there", "--temperature", "0.9",
                              "--seed", 6, "-n", 6, "--json"))
    assert other_seed != want                   # control: the seed shows in the tokens
    assert _ids(k3_here(tiny_dir, "Hello there", "--temp", "0.9", "-s", 5, "-n", 6,
                        "--json")) == want
    assert _ids(k3_here("-m", tiny_dir, "Hello there", "--temp", "0.9", "-s", 5, "-n", 6,
                        "--json")) == want
    assert _ids(k3_here(tiny_dir, "-p", "Hello there", "--temp", "0.9", "-s", 5,
                        "--n-predict", 6, "--json")) == want
    assert _ids(k3_here(tiny_dir, "-p", "Hello there", "--temp", "0.9", "-s", 5,
                        "--predict", 6, "--json")) == want


def test_system_prompt_and_file_aliases(tiny_dir, tmp_path):
    """Catches -sys/--system-prompt (llama-cli's) not being the chat's --system, and
    --file not being --prompt-file: the same transcript and tokens; control: another
    system message changes the reply."""
    talk = "Hi there\n\n"
    want = k3_here(tiny_dir, "--chat", "-n", 4, "--system", "Be brief.", input=talk).stdout
    other = k3_here(tiny_dir, "--chat", "-n", 4, "--system", "Be long and verbose.",
                    input=talk).stdout
    assert want and other != want
    for flag in ("-sys", "--system-prompt"):
        assert k3_here(tiny_dir, "--chat", "-n", 4, flag, "Be brief.", input=talk).stdout == want
    f = tmp_path / "p.txt"
    f.write_text("Hello there")
    assert _ids(k3_here(tiny_dir, "--file", f, "-n", 3, "--json")) == \
        _ids(k3_here(tiny_dir, "-f", f, "-n", 3, "--json"))


def test_run_llama_names_from_the_console_script(tiny_dir):
    """Catches the llama.cpp spelling working in-process only: the console script with a
    positional prompt, --temp, -s and -c gives --prompt's tokens."""
    want = _ids(k3_here(tiny_dir, "--prompt", "Hi", "--temperature", "0.7", "--seed", 2,
                        "-n", 4, "--json"))
    assert _ids(k3(tiny_dir, "Hi", "--temp", "0.7", "-s", 2, "-c", 64, "-n", 4,
                   "--json")) == want


def test_prompt_file_dash_reads_standard_input(tiny_dir, tmp_path):
    """Catches ``-f -`` refused as a missing file, or reading anything but stdin's bytes:
    the same tokens as the file holding them."""
    f = tmp_path / "p.txt"
    f.write_bytes(b"Hello\r\nthere")
    want = _ids(k3_here(tiny_dir, "-f", f, "-n", 4, "--json"))
    assert _ids(k3_here(tiny_dir, "-f", "-", "-n", 4, "--json",
                        input="Hello\r\nthere")) == want
    assert _ids(k3_here(tiny_dir, "-f", "-", "-n", 4, "--json", input="Hello there")) != want


def test_batch_dash_reads_standard_input(tiny_dir, tmp_path):
    """Catches ``--batch -`` refused as a missing file: the results of the lines piped in
    equal those of the same file."""
    lines = "\n".join(json.dumps({"id": i, "ids": [3 + i, 9], "gen": 3}) for i in range(3))
    f = tmp_path / "b.jsonl"
    f.write_text(lines + "\n")
    outs = []
    for src, stdin in ((f, None), ("-", lines + "\n")):
        out = tmp_path / f"r{len(outs)}.jsonl"
        p = k3_here(tiny_dir, "--batch", src, "--out", out, input=stdin)
        assert p.returncode == 0, p.stderr
        outs.append([json.loads(x)["generated_ids"] for x in out.read_text().splitlines()])
    assert len(outs[0]) == 3 and outs[0] == outs[1]


@pytest.mark.parametrize("flag", ["--parallel", "-np"])
def test_parallel_is_the_batch_width(tiny_dir, tmp_path, flag):
    """Catches --parallel (llama-server's lanes) not setting the lockstep width: the
    summary's width is the one given, as with --batch-width."""
    f = tmp_path / "b.jsonl"
    f.write_text("\n".join(json.dumps({"id": i, "ids": [5, i + 1], "gen": 2})
                           for i in range(4)) + "\n")
    for opt, width in ((flag, 3), ("--batch-width", 2)):     # control: another width
        p = k3_here(tiny_dir, "--batch", f, "--out", tmp_path / f"{opt}{width}.jsonl",
                    opt, width, "--json")
        assert p.returncode == 0, p.stderr
        assert json.loads(p.stdout)["width"] == width


@pytest.mark.parametrize("flag", ["-i", "-cnv", "--conversation"])
def test_chat_aliases_run_the_chat(tiny_dir, flag):
    """Catches -i or -cnv (llama-cli's chat) meaning anything but --chat: the same
    transcript."""
    want = k3_here(tiny_dir, "--chat", "-n", 3, input="Hi there\n\n")
    assert want.returncode == 0 and want.stdout.strip(), want.stderr
    got = k3_here(tiny_dir, flag, "-n", 3, input="Hi there\n\n")
    assert got.returncode == 0, got.stderr
    assert got.stdout == want.stdout


def test_ctx_size_refuses_a_run_that_does_not_fit(tiny_dir):
    """Catches -c/--ctx-size ignored (the run goes past it) or counting only the prompt:
    4 prompt tokens and 3 to generate fit in 7, not in 6 (one line, exit 2)."""
    for c in ("-c", "--ctx-size"):
        assert len(_ids(k3_here(tiny_dir, "--ids", "1,2,3,4", "-n", 3, c, 7, "--json"))) == 3
    check_refused(invoke(run_main, [tiny_dir, "--ids", "1,2,3,4", "-n", 3, "-c", 6]), 2,
                  "--ctx-size 6", "--gen 3")
    check_refused(invoke(run_main, [tiny_dir, "--ids", "1,2,3,4", "-n", 0, "-c", 3]), 2,
                  "--ctx-size 3", "4 tokens")


def test_ctx_size_bounds_generation_until_the_end(tiny_dir):
    """Catches -n -1 running to the model's context despite --ctx-size: it stops with the
    context full, prompt and generated tokens together."""
    p = k3_here(tiny_dir, "--ids", "1,2,3", "-n", -1, "-c", 8, "--json")
    rep = json.loads(p.stdout)
    assert p.returncode == 0 and len(rep["generated_ids"]) + 3 <= 8


@pytest.mark.parametrize("argv,says", [
    (["-ngl", "99"], "GPU"),
    (["--n-gpu-layers", "99"], "GPU"),
    (["--mlock"], "--resident"),
    (["--no-mmap"], "never maps"),
    (["-fa"], "attention"),
    (["-b", "512"], "--prefill-chunk"),
    (["-ctk", "q8_0"], "cache type"),
])
def test_llama_flags_without_meaning_are_refused_with_the_reason(tiny_dir, argv, says):
    """Catches a llama.cpp flag that has no meaning here accepted silently, or misread
    (``-ngl 99`` as ``-n gl``): one line naming the flag and why, exit 2; control: the
    same command without it runs."""
    base = [tiny_dir, "--ids", "1,2", "-n", 1]
    check_refused(invoke(run_main, base + argv), 2, argv[0], says, "llama.cpp")
    assert invoke(run_main, base).code == 0


def test_unknown_option_suggests_the_k3_name(tiny_dir):
    """Catches a suggestion list that misses --temperature for a --temp-like typo (the
    alias matched, but its option not named); control: an option like nothing here
    suggests no --temperature."""
    for typo in ("--tmp", "--temprature", "--tempe"):
        check_refused(invoke(run_main, [tiny_dir, "--ids", "1", typo, "1"]), 2, typo,
                      "--temperature")
    line = check_refused(invoke(run_main, [tiny_dir, "--ids", "1", "--zzzqqq"]), 2,
                         "--zzzqqq")
    assert "--temperature" not in line


def test_serve_address_from_host_and_port():
    """Catches --serve without a port not on llama-server's 8080, --host/--port
    ignored, an IPv6 host left unbracketed, and an address given twice accepted."""
    assert serve_address(None, None, None) is None
    assert serve_address("", None, None) == "127.0.0.1:8080"
    assert serve_address("9000", None, None) == "9000"
    assert serve_address("", "0.0.0.0", 9001) == "0.0.0.0:9001"
    assert serve_address("", "::1", None) == "[::1]:8080"
    from libk3.errors import UsageError
    with pytest.raises(UsageError, match="address once"):
        serve_address("9000", None, 9001)


def test_serve_without_a_port_serves_on_8080(tiny_dir, monkeypatch):
    """Catches ``--serve`` with no value refused or taking the next option as its
    address: the server is started on 127.0.0.1:8080; ``--serve PORT`` as before; -a
    (llama-server's alias) is the served model's name; --host/--port without --serve
    refused."""
    import libk3.serve.app as app
    seen = []
    names = []
    monkeypatch.setattr(app, "serve", lambda run, address, *a, **k: (
        seen.append(address), names.append(k["model_name"])))
    for argv in (["--serve"], ["--serve", "--gen", "2"], ["--serve", "9000"],
                 ["--serve", "--port", "9002", "-a", "k3"]):
        assert k3_here(tiny_dir, *argv).returncode == 0
    assert seen == ["127.0.0.1:8080", "127.0.0.1:8080", "9000", "127.0.0.1:9002"]
    assert names == [None, None, None, "k3"]        # -a/--alias: llama-server's model name
    check_refused(invoke(run_main, [tiny_dir, "--serve", "--host", "0.0.0.0"]), 2,
                  "--api-key")
    check_refused(invoke(run_main, [tiny_dir, "--ids", "1", "--port", "9000"]), 2,
                  "--port", "--serve")


def test_verbose_prints_the_report_and_log_disable_is_quiet(tiny_dir):
    """Catches --verbose printing nothing more (the report as --json has it goes to
    stderr), and --log-disable not being --quiet (it then combines with --verbose)."""
    plain = k3_here(tiny_dir, "--ids", "1,2", "-n", 2)
    loud = k3_here(tiny_dir, "--ids", "1,2", "-n", 2, "--verbose")
    assert plain.returncode == loud.returncode == 0
    assert '"generated_ids"' in loud.stderr and '"generated_ids"' not in plain.stderr
    assert k3_here(tiny_dir, "--ids", "1,2", "-n", 2, "--log-disable").returncode == 0
    check_refused(invoke(run_main, [tiny_dir, "--ids", "1", "--verbose", "--log-disable"]),
                  2, "--verbose")


def test_ctx_size_refuses_a_chat_turn_that_does_not_fit_and_the_chat_goes_on(tiny_dir):
    """Catches a chat turn run past --ctx-size, or a refusal that ends the chat or keeps
    the refused message: the turn over the limit is one error line, the next /stats
    counts only the turn that fitted; control: the same chat without -c runs both."""
    talk = "Hi\n" + "word " * 40 + "\n/stats\n\n"
    p = k3_here(tiny_dir, "--chat", "-n", 2, "-c", 40, input=talk)
    assert p.returncode == 0, p.stderr
    assert "error: --ctx-size 40:" in p.stderr and "turns: 1" in p.stderr
    q = k3_here(tiny_dir, "--chat", "-n", 2, input=talk)
    assert q.returncode == 0 and "error" not in q.stderr and "turns: 2" in q.stderr


def test_ctx_size_skips_the_batch_lines_that_do_not_fit(tiny_dir, tmp_path):
    """Catches --ctx-size ignored by --batch: a line whose prompt and gen run past it is
    skipped with its reason naming --ctx-size, the line that fits runs; control: without
    -c both run."""
    f = tmp_path / "b.jsonl"
    f.write_text(json.dumps({"id": "fits", "ids": [1, 2], "gen": 3}) + "\n" +
                 json.dumps({"id": "long", "ids": [1, 2, 3, 4], "gen": 3}) + "\n")
    p = k3_here(tiny_dir, "--batch", f, "--out", tmp_path / "r.jsonl", "-c", 6, "--json")
    assert p.returncode == 0, p.stderr
    s = json.loads(p.stdout)
    assert s["done"] == 1 and s["malformed"] == 1 and "--ctx-size's context of 6" in p.stderr
    q = k3_here(tiny_dir, "--batch", f, "--out", tmp_path / "r2.jsonl", "--json")
    assert json.loads(q.stdout)["done"] == 2
