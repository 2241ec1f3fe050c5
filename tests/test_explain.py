"""``flashattn explain``: the trace recorded from ``flashattn.reference`` (every step's m, l, O and gradients
against an independent NumPy computation), the page's limits and usage errors, and the page itself in headless
Chromium (the numbers shown at chosen steps are the trace's, the last step's output is the plain formula's)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from flashattn.cli import build_parser, main
from flashattn.explain import PAGE_LIMIT, record, render_page, write_page

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"


def _arrays(trace):
    return {k: np.array(v, dtype=float) for k, v in trace["inputs"].items()}


def _scores(trace):
    x, p = _arrays(trace), trace["problem"]
    S = p["scale"] * x["Q"] @ x["K"].T
    if p["causal"]:
        S = np.where(np.tri(p["n"], dtype=bool), S, -np.inf)
    return S


def _num(values):
    return np.array([[np.nan if x is None else x for x in row] if isinstance(row, list) else
                     (np.nan if row is None else row) for row in values], dtype=float)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n,d,br,bc", [(12, 4, 4, 4), (8, 3, 2, 4), (6, 5, 3, 1), (1, 2, 1, 1)])
def test_every_forward_step_against_an_independent_computation(n, d, br, bc, causal):
    trace = record(n=n, d=d, block_rows=br, block_cols=bc, causal=causal, seed=3)
    S, V = _scores(trace), _arrays(trace)["V"]
    assert len(trace["fa1"]["steps"]) == len(trace["fa2"]["steps"]) > 0
    for name in ("fa1", "fa2"):
        for step in trace[name]["steps"]:
            (r0, r1), (c0, c1) = step["rows"], step["cols"]
            seen = S[r0:r1, :c1]  # both loop orders have seen keys [0, c1) for these rows after this step
            m = seen.max(axis=1)
            shift = np.where(np.isfinite(m), m, 0.0)
            weights = np.exp(seen - shift[:, None])
            l = weights.sum(axis=1)
            np.testing.assert_allclose(_num(step["m_new"]), np.where(np.isfinite(m), m, np.nan), atol=1e-6)
            np.testing.assert_allclose(step["l_new"], l, atol=1e-6)
            block = S[r0:r1, c0:c1]
            np.testing.assert_allclose(_num(step["S"]), np.where(np.isfinite(block), block, np.nan), atol=1e-6)
            acc = weights @ V[:c1]
            want = acc if name == "fa2" else np.divide(acc, l[:, None], out=np.zeros_like(acc), where=l[:, None] > 0)
            np.testing.assert_allclose(step["O"], want, atol=1e-6)  # FA-2 unnormalised, FA-1 renormalised
    plain = trace["plain"]
    np.testing.assert_allclose(trace["fa1"]["O"], plain, atol=1e-6)
    np.testing.assert_allclose(trace["fa2"]["O"], plain, atol=1e-6)
    assert max(trace["check"].values()) < 1e-12  # computed before the page's rounding to 6 decimals


def test_backward_steps_and_traffic():
    trace = record(n=8, d=3, block_rows=2, block_cols=4, seed=1)
    x, scale = _arrays(trace), trace["problem"]["scale"]
    S = _scores(trace)
    P = np.exp(S - S.max(axis=1, keepdims=True))
    P /= P.sum(axis=1, keepdims=True)
    O = P @ x["V"]
    dP = x["dO"] @ x["V"].T
    dS = P * (dP - (x["dO"] * O).sum(axis=1, keepdims=True))
    for step in trace["backward"]["steps"]:
        (r0, r1), (c0, c1) = step["rows"], step["cols"]
        np.testing.assert_allclose(step["P"], P[r0:r1, c0:c1], atol=1e-6)
        np.testing.assert_allclose(step["dV"], P[:r1, c0:c1].T @ x["dO"][:r1], atol=1e-6)  # accumulated so far
        np.testing.assert_allclose(step["dQ"], scale * dS[r0:r1, :c1] @ x["K"][:c1], atol=1e-6)
    np.testing.assert_allclose(trace["backward"]["dK"], scale * dS.T @ x["Q"], atol=1e-6)
    for name in ("fa1", "fa2", "backward"):  # the counters only grow, and end at the totals
        moved = [s["hbm"]["reads"] + s["hbm"]["writes"] for s in trace[name]["steps"]]
        assert moved == sorted(moved) and trace[name]["steps"][-1]["hbm"] == trace[name]["hbm"]
    fa2_total = sum(trace["fa2"]["hbm"].values())
    assert fa2_total < sum(trace["standard"]["hbm"].values())  # FA-2 moves less than standard attention


def test_each_hbm_access_belongs_to_its_step():
    """Loads come with the step that uses them, stores with the step that finishes them: FA-2 writes O and L only
    at a row block's last tile, the backward writes dK_j and dV_j only at its key block's last tile, and every
    access is within the step's tile."""
    trace = record(n=8, d=4, block_rows=2, block_cols=4, causal=True)
    for step in trace["fa2"]["steps"]:
        writes = {a["array"]: a["rows"] for a in step["accesses"] if a["kind"] == "write"}
        assert set(writes) == ({"O", "L"} if "row_done" in step else set())
        assert all(rows == step["rows"] for rows in writes.values())
        assert all(a["rows"] == step["cols"] for a in step["accesses"] if a["array"] in ("K", "V"))
    steps = trace["backward"]["steps"]
    for k, step in enumerate(steps):
        last_of_column = k == len(steps) - 1 or steps[k + 1]["cols"] != step["cols"]
        written = [a for a in step["accesses"] if a["kind"] == "write" and a["array"] in ("dK", "dV")]
        assert len(written) == (2 if last_of_column else 0) and all(a["rows"] == step["cols"] for a in written)


@pytest.mark.parametrize("argv,message", [
    (["--n", "0"], "--n must be in [1, 64]"),
    (["--n", "65"], "--n must be in [1, 64]"),
    (["--d", "17"], "--d must be in [1, 16]"),
    (["--n", "10", "--block-rows", "4"], "--block-rows must divide n=10"),
    (["--block-cols", "13"], "--block-cols must be in [1, n=12]"),
    (["--n", "64", "--block-rows", "1", "--block-cols", "2"], "makes 2048 steps; at most 256"),
    (["--seed", "-1"], "--seed must be >= 0"),
    (["--n", "64", "--d", "16", "--block-rows", "64", "--block-cols", "1"], "over the 2 MB limit"),
])
def test_bad_options_are_usage_errors(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as done:
        main(["explain", "--out", str(tmp_path / "x.html"), *argv])
    assert done.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "x.html").exists()
    with pytest.raises(ValueError, match=re.escape(message)):
        options = {a.strip("-").replace("-", "_"): int(b) for a, b in zip(argv[::2], argv[1::2], strict=True)}
        render_page(record(**{"n": 12, **options}))


def test_out_takes_a_folder_or_a_page_and_a_bad_path_is_a_usage_error(tmp_path, capsys):
    """``--out DIR`` (existing or not) writes DIR/explain.html with its pictures beside it, as ``demo --out`` takes
    a folder; a path through a file is a usage error naming it, never a traceback."""
    folder = tmp_path / "existing"
    folder.mkdir()
    assert main(["explain", "--out", str(folder)]) == 0 and (folder / "explain.html").is_file()
    assert main(["explain", "--out", str(tmp_path / "new" / "deeper")]) == 0
    assert (tmp_path / "new" / "deeper" / "explain.html").is_file()
    (tmp_path / "a-file").write_text("")
    with pytest.raises(SystemExit) as done:
        main(["explain", "--out", str(tmp_path / "a-file" / "page.html")])
    assert done.value.code == 2 and "a-file is a file, not a folder" in capsys.readouterr().err
    help_text = build_parser().parse_known_args(["explain"])[0].parser.format_help()
    assert ") (" not in help_text  # no two parentheses run together


def test_the_page_is_self_contained_and_small(tmp_path):
    assert main(["explain", "--out", str(tmp_path / "e.html"), "--causal"]) == 0
    html = (tmp_path / "e.html").read_text()
    assert len(html.encode()) < PAGE_LIMIT and "__TRACE__" not in html
    assert not re.search(r"""(src|href)\s*=\s*["'](?!#)""", html), "the page loads nothing from elsewhere"
    data = json.loads(re.search(r'<script id="trace" type="application/json">(.*?)</script>', html, re.S).group(1))
    assert data["problem"]["causal"] is True and data == json.loads(json.dumps(record(causal=True)))
    big = write_page(record(n=64, d=16, block_rows=4, block_cols=4), tmp_path / "big.html")
    assert big.stat().st_size < PAGE_LIMIT


def test_pictures(tmp_path):
    pytest.importorskip("matplotlib")
    assert main(["explain", "--out", str(tmp_path / "e.html"), "--pictures"]) == 0
    png, gif = (tmp_path / "e.png").read_bytes(), (tmp_path / "e.gif").read_bytes()
    assert png.startswith(b"\x89PNG") and gif.startswith(b"GIF89a") and gif.count(b"\x21\xf9\x04") == 9  # frames


class _Shown(HTMLParser):
    """Every displayed number: elements with data-name (and data-i, data-j) and their text."""

    def __init__(self):
        super().__init__()
        self.values: dict[tuple, str] = {}
        self.body: dict[str, str] = {}
        self._open = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "body":
            self.body = a
        if "data-name" in a:
            self._open = (a["data-name"], int(a.get("data-i", -1)), int(a.get("data-j", -1)))

    def handle_data(self, data):
        if self._open is not None:
            self.values[self._open] = self.values.get(self._open, "") + data

    def handle_endtag(self, tag):
        self._open = None


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def _open(browser: str, page: Path, fragment: str, *extra: str) -> _Shown:
    done = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", *extra, "--dump-dom",
                           f"file://{page}#{fragment}"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    shown = _Shown()
    shown.feed(done.stdout)
    return shown


def _shown_matrix(shown: _Shown, name: str) -> np.ndarray:
    cells = {(i, j): text for (n, i, j), text in shown.values.items() if n == name}
    rows, cols = max(i for i, _ in cells) + 1, max(j for _, j in cells) + 1
    return np.array([[np.nan if cells[i, j] == "\u2212\u221e" else float(cells[i, j]) for j in range(cols)]
                     for i in range(rows)])


@pytest.mark.skipif(_chromium() is None, reason="no Chromium here (Debian's chromium package; .ci/run installs it)")
def test_the_page_in_a_real_browser(tmp_path):
    browser = _chromium()
    trace = record(causal=True, seed=2)
    page = write_page(trace, tmp_path / "explain.html")
    last = len(trace["fa2"]["steps"]) - 1
    for act, name, steps in (("forward", "fa2", (0, 2, last)), ("forward", "fa1", (1, last)),
                             ("backward", "backward", (0, 4))):
        for k in steps:
            shown = _open(browser, page, f"act={act}&step={k}")
            assert shown.body["data-act"] == act and shown.body["data-step"] == str(k)
            step = trace[name]["steps"][k]
            for key in ("S", "P", "O", "dQ", "dV"):
                if key in step:
                    np.testing.assert_allclose(_shown_matrix(shown, f"{name}.{key}"), _num(step[key]), atol=5e-4)
            for key in ("m_new", "l_new", "rescale") if name != "backward" else ():
                got = np.array([float(shown.values[(f"{name}.{key}", i, -1)]) for i in range(len(step[key]))])
                np.testing.assert_allclose(got, step[key], atol=5e-4)
            assert int(shown.values[(f"{name}.hbm.reads", -1, -1)].split()[0]) == step["hbm"]["reads"]
    final = _open(browser, page, f"act=forward&step={last}")
    np.testing.assert_allclose(_shown_matrix(final, "final.fa2"), _shown_matrix(final, "final.plain"), atol=1e-3)
    np.testing.assert_allclose(_shown_matrix(final, "final.plain"), trace["plain"], atol=5e-4)
    # The play control steps on by itself: in virtual time the whole forward plays to its last step.
    played = _open(browser, page, "act=forward&step=0&play", "--virtual-time-budget=30000")
    assert played.body["data-step"] == str(last)
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "explain-step-3.png"
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--window-size=1400,1500", f"--screenshot={shot}", f"file://{page}#act=forward&step=2"],
                   capture_output=True, timeout=120, check=True)
    assert shot.read_bytes().startswith(b"\x89PNG")
