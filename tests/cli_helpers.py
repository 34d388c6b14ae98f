"""Run the `pagedllm` command line in-process and capture what it printed."""

from pagedllm.entrypoints.cli.main import main


def cli(capsys, *argv):
    """(exit code, stdout, stderr) of `pagedllm ARGV`."""
    try:
        rc = main(list(argv))
    except SystemExit as e:  # argparse: --help, or a flag it cannot parse
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err
