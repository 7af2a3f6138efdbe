# Sphinx configuration of the docs site. Its sources are written by docs/adapt.py into _proc/.site/ (run `make docs`).
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parent))
from adapt import DOC_URL, project_urls, settings

_s = settings()
project,author,copyright = _s['lib_name'],_s['author'],_s['copyright']
version = release = _s['version']

extensions = ['myst_nb']
nb_execution_mode = 'off'  # nbdev-test executes and checks the notebooks; the site shows the outputs saved in them
nb_merge_streams = True
myst_enable_extensions = ['colon_fence']
myst_heading_anchors = 3  # `page.ipynb#some-heading` links resolve, and -n checks them
suppress_warnings = ['myst.header']  # show_doc's `###` headings may follow a page title directly
exclude_patterns = ['**/.ipynb_checkpoints']

html_theme = 'sphinx_book_theme'
html_title = project
html_baseurl = DOC_URL  # settings.ini's doc_url: empty until the site is published
_git = project_urls().get('git_url')  # settings.ini's: the theme's repository button links it, once there is one
html_copy_source = html_show_sourcelink = False
html_static_path = ['_static']
html_css_files = ['mpx.css']
html_theme_options = dict(
    **(dict(repository_url=_git, repository_branch=_s.get('branch', 'main'), use_repository_button=True) if _git else {}),
    use_download_button=False,  # it would offer the notebook sources, which the site does not copy
    home_page_in_toc=True, show_toc_level=2, navigation_with_keys=False)
# one search box: the header's (the theme's sidebar repeats it as a field of its own)
html_sidebars = {'**': ['navbar-logo.html', 'icon-links.html', 'sbt-sidebar-nav.html']}
html_favicon = '_static/favicon.svg'  # without one the browser asks for /favicon.ico and logs a 404
html_context = dict(default_mode='light')  # pydata-sphinx-theme logs an error on a fresh profile without it
