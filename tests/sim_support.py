"""Shared by the simulator's tests: running ``hotprefix simulate`` and expecting a usage error."""

from __future__ import annotations

from hotprefix import simulate as sim


def exit_2(argv: list[str], capsys) -> str:
    """Run ``simulate argv``; assert exit status 2 (returned, or argparse's) and no traceback;
    return stderr."""
    try:
        rc = sim.main(argv)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    return err
