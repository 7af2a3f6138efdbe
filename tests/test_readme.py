"""README.md's code blocks run as written, in order: the python blocks in one namespace, as a reader pastes them into a
session, each shown output checked against what the block's last expression prints today; the shell blocks' `make`
targets exist and their `pip install` extras are settings.ini's."""
import ast, configparser, re, subprocess
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT/'README.md').read_text()

def blocks(md:str) -> list:
    "The fenced code blocks of `md` in order, as (language, code, the indented output that follows it or None)"
    pat = re.compile(r'^```(\w*)\n(.*?)^```\n(?:\n((?:(?: {4}[^\n]*)?\n)+))?', re.M | re.S)
    return [(m[1], m[2], None if m[3] is None else '\n'.join(l[4:] for l in m[3].strip('\n').splitlines()).strip())
            for m in pat.finditer(md)]

def test_blocks_found():
    "The parser finds the README's blocks, and the outputs shown under them."
    langs = [b[0] for b in blocks(README)]
    assert langs.count('python') >= 3 and langs.count('sh') >= 3, langs
    assert any(o for _,_,o in blocks(README)), 'no shown output found'
    assert blocks('```python\nx\n```\n\n    1\n    2\n\nmore')[0] == ('python', 'x\n', '1\n2')

def run_block(code:str, ns:dict):
    "Run `code` in `ns` as a notebook cell: the repr of its last expression, or None"
    tree = ast.parse(code)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, '<README.md>', 'exec'), ns)
    return None if last is None else eval(compile(ast.Expression(last.value), '<README.md>', 'eval'), ns)

def test_python_blocks_run_in_order():
    "Every python block runs after the ones above it, and each output the README shows is what its block gives today."
    ns,ran = {},0
    for lang,code,shown in blocks(README):
        if lang != 'python': continue
        res = run_block(code, ns)
        ran += 1
        if shown is not None: assert repr(res) == shown, (code, repr(res), shown)
    assert ran >= 3

def test_sh_blocks_name_what_exists():
    "Each `make` target the README's shell blocks name exists (make -n), and each extra they install is one settings.ini declares."
    cfg = configparser.ConfigParser(delimiters=['='])
    cfg.read(ROOT/'settings.ini')
    extras = {k[:-len('_requirements')] for k in cfg['DEFAULT'] if k.endswith('_requirements') and k != 'requirements'}
    cmds = [l.split('#')[0].strip() for lang,code,_ in blocks(README) if lang == 'sh' for l in code.splitlines()]
    assert [c for c in cmds if c.startswith('make ')] and [c for c in cmds if c.startswith('pip install')], cmds
    for c in cmds:
        if c.startswith('make '):
            p = subprocess.run(['make', '-n', *c.split()[1:]], cwd=ROOT, capture_output=True, text=True)
            assert p.returncode == 0, (c, p.stderr)
        elif c.startswith('pip install'):
            for e in re.findall(r"\[([\w,]+)\]", c): assert set(e.split(',')) <= extras, (c, extras)
        else: pytest.fail(f"a shell command this test does not check: {c!r}")
