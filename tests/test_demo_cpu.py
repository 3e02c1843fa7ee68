"""The demo suite on 8 virtual CPU devices: every row runs, checks against XLA, and the summary prints."""

from pk_jax.bench import demo


def test_demo_runs_every_family_and_matches_xla(capsys):
    rows = demo.run(reps=2)
    assert {r["family"] for r in rows} == {"GEMM (1 GPU)", "attention (1 GPU)", "collectives", "fused GEMMs"}
    assert all("skipped" not in r and r["extra"]["check"] == "ok" for r in rows)
    assert {r["op"] for r in rows} >= {"matmul", "all_gather", "all_reduce", "all_gather_matmul"}
    demo.print_summary(rows)
    assert "speedup" in capsys.readouterr().out


def test_demo_on_one_device_runs_the_one_gpu_rows_and_says_what_needs_more(monkeypatch):
    one = demo.jax.devices()[:1]
    monkeypatch.setattr(demo.jax, "devices", lambda *a: one)
    rows = demo.run(reps=2)
    ran = [r for r in rows if "skipped" not in r]
    assert [r["op"] for r in ran] == ["matmul", "attention"] and all(r["extra"]["check"] == "ok" for r in ran)
    assert all(r["skipped"] == "needs 2 GPUs" for r in rows if r["op"] not in ("matmul", "attention"))
