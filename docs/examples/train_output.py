"""What `equishard train` prints and writes, from a real (shortened) run.

The code of the guide `docs/guides/train-output.md`. Run it on a laptop CPU:

    python docs/examples/train_output.py
"""

# --8<-- [start:run]
import json
import pathlib
import subprocess
import sys
import tempfile

work = pathlib.Path(tempfile.mkdtemp())  # the run directory is runs/train in there
# A short run of the tiny model: 20 steps, a step-log line every 5, validation every 10.
argv = [sys.executable, "-m", "equishard", "train", "--model", "tiny", "--steps", "20",
        "--batch-size", "8", "--seq-len", "32", "--log-every", "5", "--eval-every", "10",
        "--checkpoint-every", "10", "--sample-bytes", "0", "--no-tensorboard"]  # fmt: skip
done = subprocess.run(argv, capture_output=True, text=True, check=True, cwd=work)
print(done.stdout)
# --8<-- [end:run]

# --8<-- [start:bar]
# The progress bar is drawn only where stderr is a terminal: here it is a pipe.
print(f"progress bar lines on stderr: {done.stderr.count('train:')}")
# --8<-- [end:bar]

# --8<-- [start:files]
run_dir = work / "runs" / "train"
for path in sorted(run_dir.iterdir()):
    print(f"{path.name + ('/' if path.is_dir() else ''):16} {path.stat().st_size if path.is_file() else ''}")
rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
print(json.dumps(rows[-2], indent=1))  # the last step's row (the last row is its validation)
print((run_dir / "config.toml").read_text())
# --8<-- [end:files]
