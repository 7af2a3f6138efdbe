"""How easy the engine's code is to read cold: four counts over a source tree of mpx.

Prints one short report: 1. parameters with one-letter names, over all of `mpx/*.py` (not `_modidx.py`) and over the
engine modules, with the 10 functions that have the most; 2. tokens a code line (comments and docstrings left out);
3. the methods of the 5 largest classes, their own and with their mpx bases'; 4. the Python frames from the engine's
`FusedSteps.step` to the line of Adam's arithmetic in `fused='compile'`, run eagerly (`torch.compiler.set_stance`'s
'force_eager': `torch.compile`d functions run as plain Python) on a tiny learner. 1 to 3 read the files; 4 imports
the package, from `--root`'s parent. Run: `.venv/bin/python bench/reading.py [--root path/to/mpx]`."""
import argparse, ast, inspect, sys, tokenize, warnings
from collections import Counter
from pathlib import Path

ENGINE = {'fused.py', 'flat.py', 'eager.py', 'compiled.py', 'foreign.py', 'lowbit.py', 'pure.py', 'callback.py',
          'checkpoint.py', 'plumbing.py'}
SKIPPED = {'NL', 'NEWLINE', 'COMMENT', 'INDENT', 'DEDENT', 'ENCODING', 'ENDMARKER'}

def sources(root:Path) -> dict:
    "Each module's file of `root` by its name, `_modidx.py` left out"
    return {path.name: path for path in sorted(root.glob('*.py')) if path.name != '_modidx.py'}

def functions(tree:ast.Module, prefix:str=''):
    "Each function definition of `tree` with its qualified name, nested ones included"
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from functions(node, f"{prefix}{node.name}.<locals>.")
        elif isinstance(node, ast.ClassDef): yield from functions(node, f"{prefix}{node.name}.")
        else: yield from functions(node, prefix)

def param_names(func:ast.FunctionDef) -> list:
    "The names of `func`'s parameters, `self` and `cls` left out"
    spec = func.args
    params = spec.posonlyargs + spec.args + spec.kwonlyargs + [arg for arg in (spec.vararg, spec.kwarg) if arg]
    return [arg.arg for arg in params if arg.arg not in ('self', 'cls')]

def one_letter_report(trees:dict):
    "Print the share of one-letter parameters, all modules and engine modules, and the 10 functions with the most"
    counts,worst = {'all': [0, 0], 'engine': [0, 0]},[]
    for name,tree in trees.items():
        for qualname,func in functions(tree):
            params = param_names(func)
            short = [param for param in params if len(param) == 1]
            for group in ['all'] + ['engine']*(name in ENGINE):
                counts[group][0] += len(short)
                counts[group][1] += len(params)
            if short: worst.append((len(short), f"{name[:-3]}.{qualname}", short))
    for group,(short,total) in counts.items():
        print(f"one-letter parameters, {group} modules: {short} of {total} ({short/max(total, 1):.0%})")
    for count,qualname,short in sorted(worst, key=lambda row: -row[0])[:10]:
        print(f"  {count}  {qualname}: {', '.join(short)}")

def docstring_lines(tree:ast.Module) -> set:
    "The lines of `tree`'s docstrings: a string that is a module's, class's or function's first statement"
    lines = set()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)): continue
        first = node.body[0] if node.body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            lines.update(range(first.lineno, first.end_lineno + 1))
    return lines

def token_counts(path:Path, tree:ast.Module) -> tuple:
    "The code tokens of `path` and the lines they start on (no comments, docstrings or layout tokens)"
    skip,n_tokens,lines = docstring_lines(tree),0,set()
    with path.open('rb') as file:
        for tok in tokenize.tokenize(file.readline):
            if tokenize.tok_name[tok.type] in SKIPPED or tok.start[0] in skip: continue
            n_tokens += 1
            lines.add(tok.start[0])
    return n_tokens,len(lines)

def tokens_report(paths:dict, trees:dict):
    "Print the tokens a code line, all modules and engine modules"
    counts = {name: token_counts(path, trees[name]) for name,path in paths.items()}
    for group,names in (('all', counts), ('engine', ENGINE & counts.keys())):
        n_tokens,n_lines = (sum(counts[name][i] for name in names) for i in (0, 1))
        print(f"tokens a code line, {group} modules: {n_tokens/n_lines:.2f} ({n_tokens} tokens on {n_lines} lines)")

def base_name(node:ast.expr) -> str:
    "The name a base class is written with (`fused.FusedSteps`: `FusedSteps`)"
    if isinstance(node, ast.Subscript): node = node.value
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, 'id', '')

def classes_report(trees:dict):
    "Print the 5 classes with the most methods of their own, and their count with their mpx bases'"
    classes = {}  # by name: (the methods' names, the bases' names); a name defined twice: the first
    for tree in trees.values():
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef) or node.name in classes: continue
            methods = {item.name for item in node.body if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))}
            classes[node.name] = (methods, [base_name(base) for base in node.bases])
    def ancestors(name:str) -> list:
        "The mpx classes `name` derives from, by walking the bases' names"
        found = []
        for base in classes[name][1]:
            if base in classes and base not in found: found += [base] + [a for a in ancestors(base) if a not in found]
        return found
    for name in sorted(classes, key=lambda name: -len(classes[name][0]))[:5]:
        bases = ancestors(name)
        total = set().union(classes[name][0], *(classes[base][0] for base in bases))
        print(f"  {name}: own {len(classes[name][0])}, with mpx bases {len(total)} (bases: {', '.join(bases) or '-'})")

def tiny_adam_learner():
    "A tiny fastai learner on synthetic data, stepping with Adam"
    from fastai.optimizer import Adam
    try: from mpx.test_learners import tiny_learner
    except ImportError:
        from fastai.test_utils import synth_learner
        return synth_learner(opt_func=Adam)
    return tiny_learner(opt_func=Adam)

def frame_label(frame:inspect.FrameInfo, root:Path) -> tuple:
    "A frame's function with its module's name, and whether its file is in mpx at `root`"
    path = Path(frame.filename).resolve()
    ours = path.is_relative_to(root)
    where = path.stem if ours else '.'.join(path.with_suffix('').parts[-3:])
    return f"{frame.function} ({where})",ours

def adam_stack(root:Path) -> list|str:
    "The frames (innermost first) at Adam's compiled update in one step, or why the measure does not apply"
    import torch
    import mpx.all  # noqa: F401 (patches `Learner.to_bf16`)
    import mpx.compiled as compiled
    if Path(compiled.__file__).resolve().parent != root: return f"mpx imported from {compiled.__file__}, not {root}"
    if not hasattr(compiled, '_AdamStep'): return "mpx.compiled has no _AdamStep"
    original,stacks = compiled._AdamStep.__dict__['update'],[]
    def update(vals, run, kw):
        if not stacks: stacks.append(inspect.stack())
        return original.__func__(vals, run, kw)
    learn = tiny_adam_learner().to_bf16(fused='compile')
    compiled._AdamStep.update = staticmethod(update)
    try:
        with torch.compiler.set_stance('force_eager'), learn.no_bar(), learn.no_logging(): learn.fit(1)
    finally: compiled._AdamStep.update = original
    return stacks[0] if stacks else "Adam's compiled update never ran (the step went eager)"

def frames_line(root:Path) -> str:
    "The frames from the engine's step to Adam's compiled arithmetic, as a line"
    what = "frames opt.step() -> Adam's line, compiled"
    sys.path.insert(0, str(root.parent))
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        try: stack = adam_stack(root)
        except Exception as e: stack = f"{type(e).__name__}: {e}"
    if isinstance(stack, str): return f"{what}: does not apply ({stack})"
    steps = [i for i,frame in enumerate(stack) if frame.frame.f_code.co_qualname == 'FusedSteps.step']
    if not steps: return f"{what}: does not apply (no FusedSteps.step frame)"
    labels = [frame_label(frame, root) for frame in reversed(stack[:steps[0] + 1])]
    labels[-1] = ('update (compiled)', True)  # the wrapper's frame, in place of `_AdamStep.update`'s
    ours = sum(mine for _,mine in labels)
    return f"{what}: {ours} of mpx + {len(labels) - ours} of torch's: " + ' > '.join(label for label,_ in labels)

def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--root', type=Path, default=Path(__file__).resolve().parents[1]/'mpx', help="mpx's directory")
    root = parser.parse_args().root.resolve()
    paths = sources(root)
    trees = {name: ast.parse(path.read_text(), str(path)) for name,path in paths.items()}
    print(f"# reading {root}: {len(paths)} modules, {len(ENGINE & paths.keys())} of the engine")
    one_letter_report(trees)
    tokens_report(paths, trees)
    print("methods of the largest classes:")
    classes_report(trees)
    print(frames_line(root))

if __name__ == '__main__': main()
