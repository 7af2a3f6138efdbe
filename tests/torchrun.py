"Launch a test worker on 2 CPU processes with torchrun (gloo over loopback), shared by the multi-process tests."
import os, subprocess, sys
from pathlib import Path
import psutil, pytest

TESTS = Path(__file__).parent

def launch(worker:str, out, *args, timeout:int=180):
    "Run `worker` on 2 ranks with torchrun; on a timeout kill torchrun and every process under it, so no rank outlives the test"
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2', str(TESTS/worker), str(out), *args]
    p = subprocess.Popen(cmd, cwd=TESTS, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, 'OMP_NUM_THREADS': '1'})
    try: log,_ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for q in [*psutil.Process(p.pid).children(recursive=True), psutil.Process(p.pid)]: q.kill()  # ranks are not in torchrun's group
        p.communicate()
        pytest.fail(f'the 2-process run of {worker} did not finish in {timeout} s')
    assert p.returncode == 0, log.decode()[-3000:]
