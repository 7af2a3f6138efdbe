"""The pages that extend mpx as a user would (a state format, a weight kind, a step function) use public names only: no private name of
mpx's (a `_name`), no monkeypatch (an attribute of something imported, assigned or `setattr`), in any code cell."""
import ast, json
from pathlib import Path
import pytest

NBS = Path(__file__).parent.parent/'nbs'
PAGES = ['own_state.ipynb', 'own_kind.ipynb', 'own_step.ipynb']

def _code(page:str) -> str:
    "The page's code cells, magics and nbdev directives left out"
    cells = json.loads((NBS/page).read_text())['cells']
    src = [''.join(c['source']) for c in cells if c['cell_type'] == 'code']
    return '\n'.join(l for s in src for l in s.splitlines() if not l.lstrip().startswith(('%', '!', '#|')))

def private_names(tree:ast.AST) -> list:
    "Names and attributes that begin with one underscore (not `_` alone, not a dunder)"
    names = [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)]
    names += [n.id for n in ast.walk(tree) if isinstance(n, ast.Name)]
    names += [a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names]
    names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    parts = [p for n in names for p in n.split('.')]
    return sorted({p for p in parts if p.startswith('_') and p != '_' and not (p.startswith('__') and p.endswith('__'))})

def monkeypatches(tree:ast.AST) -> list:
    "Assignments to an attribute of an imported name (or of something reached from one), and `setattr` calls"
    imported = {a.asname or a.name.split('.')[0] for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in n.names if a.name != '*'}
    def root(t):
        while isinstance(t, (ast.Attribute, ast.Subscript)): t = t.value
        return t.id if isinstance(t, ast.Name) else None
    targets = [t for n in ast.walk(tree) if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign))
               for t in (n.targets if isinstance(n, ast.Assign) else [n.target])]
    res = [ast.unparse(t) for t in targets if isinstance(t, ast.Attribute) and root(t) in imported]
    res += [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, 'id', None) == 'setattr']
    return res

@pytest.mark.parametrize('page', PAGES)
def test_public_names_only(page):
    "Each extension page's code reaches mpx through public names alone, and patches nothing"
    tree = ast.parse(_code(page))
    assert not private_names(tree), f'{page}: private names {private_names(tree)}'
    assert not monkeypatches(tree), f'{page}: monkeypatches {monkeypatches(tree)}'

def test_the_checks_can_fail():
    "The two checks find a private name and a monkeypatch where there is one"
    tree = ast.parse("from mpx.core import _kinds\nimport mpx.pure\nmpx.pure.KahanKind.bytes = 1\nx = b._runs\nsetattr(y, 'a', 1)\nself.w = 2")
    assert private_names(tree) == ['_kinds', '_runs']
    assert monkeypatches(tree) == ['mpx.pure.KahanKind.bytes', "setattr(y, 'a', 1)"]
