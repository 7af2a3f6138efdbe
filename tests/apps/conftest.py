"""tests/apps run on the apps' stack (`make apptest`: `.venv-apps`, constraints-apps.txt), where torchvision imports beside torch.
On the main stack (torch's CPU wheel) torchvision cannot import: collecting these files there is an error that says so, not a
silent skip. The images the vision tests train on are written here, once a session."""
import numpy as np, pytest

try: import torchvision  # noqa: F401
except Exception as e:
    raise pytest.UsageError(f"tests/apps need the apps' stack, where torchvision imports (run `make apptest`); here: "
                            f"{type(e).__name__}: {str(e).splitlines()[0][:120]}") from None

def write_images(path, n:int=16, size:int=48, seed:int=0):
    "`n` training and `n//2` validation PNGs a class under `path`: noise with a bright square in the left or the right half"
    from PIL import Image
    rng = np.random.default_rng(seed)
    for split,k in (('train', n), ('valid', n//2)):
        for c in ('left', 'right'):
            (path/split/c).mkdir(parents=True)
            for i in range(k):
                a = rng.integers(0, 60, (size, size, 3), dtype=np.uint8)
                x,y = rng.integers(0, size//2 - 12) + (size//2 if c == 'right' else 0),rng.integers(0, size - 12)
                a[y:y+12, x:x+12] = rng.integers(180, 255, 3)
                Image.fromarray(a).save(path/split/c/f'{i}.png')
    return path

@pytest.fixture(scope='session')
def images(tmp_path_factory): return write_images(tmp_path_factory.mktemp('images'))
