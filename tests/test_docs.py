# SPDX-License-Identifier: BSD-3-Clause
"""The documentation holds together: README.md is a front page of at most 300 lines that
links every page of docs/, every relative link and heading anchor in README.md and docs/
resolves (as GitHub renders them), every Python file starts with the SPDX line the
README says it does, and a table the docs quote from benchmarks/copy_size.py is what it
prints for the code as it is now. Reads files only (copy_size.py too): no torch, fast."""

import pathlib
import re
import shlex
import shutil
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
SPDX = '# SPDX-License-Identifier: BSD-3-Clause'
MAX_README_LINES = 300

FENCE = re.compile(r'^ {0,3}(```+|~~~+)')
HEADING = re.compile(r'^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$')
# [text](target) or [text](target "title"); images (![alt](src)) are links too.
LINK = re.compile(r'\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+"[^"]*")?\s*\)')
INLINE_CODE = re.compile(r'(`+)(?:(?!\1).)+?\1')


def pages():
  return [REPO / 'README.md', *sorted((REPO / 'docs').glob('*.md'))]


def lines_outside_fences(text):
  """(line number, line) of every line not inside a fenced code block."""
  fence = None
  for number, line in enumerate(text.split('\n'), 1):
    match = FENCE.match(line)
    if fence is None and match:
      fence = match.group(1)
    elif fence is not None and match and match.group(1)[0] == fence[0] and \
        len(match.group(1)) >= len(fence) and not line.strip()[len(match.group(1)):].strip():
      fence = None
    elif fence is None:
      yield number, line


def slug(heading):
  """GitHub's anchor for a heading: inline markup dropped, lowercase, every character but
  letters, digits, spaces, hyphens and underscores removed, spaces made hyphens."""
  text = re.sub(r'!?\[([^\]]*)\]\([^)]*\)', r'\1', heading)  # A link: its text.
  text = re.sub(r'<[^>]+>', '', text)  # HTML tags.
  text = text.replace('`', '').replace('*', '')
  text = text.strip().lower()
  text = ''.join(c for c in text if c.isalnum() or c in ' -_')
  return text.replace(' ', '-')


def anchors(path):
  """Every anchor the headings of a Markdown file give, repeated ones as GitHub numbers
  them (name, name-1, name-2, ...)."""
  found, seen = set(), {}
  for _, line in lines_outside_fences(path.read_text()):
    match = HEADING.match(line)
    if not match:
      continue
    base = slug(match.group(2))
    count = seen.get(base, 0)
    seen[base] = count + 1
    found.add(base if count == 0 else f'{base}-{count}')
  return found


def links(path):
  """(line number, target) of every link in a Markdown file, outside code blocks and code
  spans."""
  for number, line in lines_outside_fences(path.read_text()):
    for match in LINK.finditer(INLINE_CODE.sub('', line)):
      yield number, match.group(1)


def broken_link(page, target):
  """Why a link from page to target does not resolve, or None if it does."""
  if re.match(r'[a-z][a-z0-9+.-]*:', target, re.I):  # http:, https:, mailto:, ...
    return None
  file_part, _, anchor = target.partition('#')
  linked = page if not file_part else (page.parent / file_part).resolve()
  if not linked.exists():
    return f'{file_part} does not exist'
  if REPO not in linked.parents and linked != REPO:
    return f'{file_part} is outside the repo'
  if anchor and linked.suffix == '.md' and anchor not in anchors(linked):
    return f'no heading of {linked.relative_to(REPO)} gives #{anchor}'
  return None


def test_readme_is_a_front_page_that_links_every_docs_page():
  readme = REPO / 'README.md'
  count = len(readme.read_text().splitlines())
  assert count <= MAX_README_LINES, f'README.md has {count} lines, more than {MAX_README_LINES}'
  docs = sorted((REPO / 'docs').glob('*.md'))
  assert docs, 'docs/ holds no page'
  linked = {(readme.parent / target.partition('#')[0]).resolve()
            for _, target in links(readme) if target.partition('#')[0]}
  missing = [str(page.relative_to(REPO)) for page in docs if page.resolve() not in linked]
  assert not missing, f'README.md links no line to: {", ".join(missing)}'


def test_every_relative_link_and_anchor_resolves():
  broken = []
  for page in pages():
    for number, target in links(page):
      why = broken_link(page, target)
      if why:
        broken.append(f'{page.relative_to(REPO)}:{number}: ({target}) {why}')
  assert not broken, 'broken links:\n' + '\n'.join(broken)


def test_slug_follows_githubs_rule(tmp_path):
  page = tmp_path / 'page.md'
  page.write_text('# Notes\n\n## Notes\n\n```\n# Notes\n```\n\n### Notes\n')
  assert anchors(page) == {'notes', 'notes-1', 'notes-2'}  # Not the line in the code block.
  assert slug('Checkpoints, resume and preemption') == 'checkpoints-resume-and-preemption'
  assert slug('Precision: float32, --amp, --bf16') == 'precision-float32---amp---bf16'
  assert slug('train_resnet_mp.py') == 'train_resnet_mppy'
  assert slug('Exit codes of `launch_pod.py`') == 'exit-codes-of-launch_podpy'


def python_files():
  """The Python files the repo tracks (git ls-files), or every one under it without git."""
  if shutil.which('git') and (REPO / '.git').exists():
    done = subprocess.run(['git', 'ls-files', '*.py'], cwd=REPO, capture_output=True,
                          text=True, check=True)
    return [REPO / name for name in done.stdout.splitlines() if (REPO / name).exists()]
  return [path for path in REPO.rglob('*.py')
          if not any(part.startswith('.') or part == '__pycache__'
                     for part in path.relative_to(REPO).parts)]


def test_every_python_file_starts_with_its_spdx_line():
  files = python_files()
  assert files
  without = [str(path.relative_to(REPO)) for path in files
             if path.read_text().split('\n', 1)[0] != SPDX]
  assert not without, f'no "{SPDX}" first line: {", ".join(without)}'


def tables(text):
  """[(header line, [row lines])] of the Markdown tables in text, the separator row left out."""
  found, block = [], []
  for line in text.split('\n') + ['']:
    if line.startswith('|'):
      block.append(line.strip())
    elif block:
      found.append((block[0], block[2:]))
      block = []
  return found


def test_the_docs_quote_copy_size_py_as_it_prints_now():
  # Its counts move with every change to a script or utils.py: a figure copied into a page
  # by hand drifts (a copier was once told 1,007 lines where the kit had 1,059).
  done = subprocess.run([sys.executable, str(REPO / 'benchmarks' / 'copy_size.py')],
                        capture_output=True, text=True, timeout=120)
  assert done.stdout, done.stderr
  printed = dict(tables(done.stdout))
  quotes = [(page, header, rows) for page in pages() for header, rows in tables(page.read_text())
            if header in printed]
  assert quotes, f'no page quotes a table of benchmarks/copy_size.py; it prints:\n{done.stdout}'
  stale = [f'{page.relative_to(REPO)}: the table that starts "{header[:40]}..." holds\n'
           + '\n'.join(rows) + '\nwhere benchmarks/copy_size.py now prints\n'
           + '\n'.join(printed[header])
           for page, header, rows in quotes if rows != printed[header]]
  assert not stale, '\n\n'.join(stale)


def test_every_page_gives_one_imagenet_command():
  # The ImageNet job is one command: its flags the same on every page that gives it (the
  # launcher's and xpk's around it, a checkpoint folder and a compile cache of their own).
  commands = {}
  for path in [*pages(), REPO / 'train_wds_cifar.py']:
    text = path.read_text().replace('\\\n', ' ')
    for found in re.finditer(r'train_wds_cifar\.py (--img_dim 224 [^\n"]*)', text):
      words = shlex.split(found.group(1).replace('BUCKET', 'my-bucket'))
      for own in ('--ckpt_dir', '--compile_cache_dir'):
        if own in words:
          del words[words.index(own):words.index(own) + 2]
      commands.setdefault(' '.join(words), []).append(path.name)
  assert len(commands) == 1 and len(next(iter(commands.values()))) >= 5, commands
