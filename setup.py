from configparser import ConfigParser
from pathlib import Path
import setuptools

cfg = ConfigParser(delimiters=['='])
cfg.read('settings.ini', encoding='utf-8')
cfg = cfg['DEFAULT']
licenses = dict(apache2='Apache-2.0')  # SPDX expressions, as setuptools wants them
statuses = ['1 - Planning', '2 - Pre-Alpha', '3 - Alpha', '4 - Beta', '5 - Production/Stable', '6 - Mature', '7 - Inactive']
py_versions = '3.10 3.11 3.12 3.13'.split()
min_python = cfg['min_python']
readme = Path('README.md')
extras = {k: cfg[f'{k}_requirements'].split() for k in ('fsdp', 'fp8')}  # one a feature; dev takes them all
urls = {'Source': cfg.get('git_url', ''), 'Documentation': cfg.get('doc_url', '')}  # settings.ini's; empty until published

setuptools.setup(
    name=cfg['lib_name'], version=cfg['version'], description=cfg['description'],
    license=licenses[cfg['license']], license_files=['LICENSE'], author=cfg['author'], keywords=cfg['keywords'],
    url=cfg.get('git_url') or None, project_urls={k: v for k,v in urls.items() if v},
    classifiers=['Development Status :: ' + statuses[int(cfg['status']) - 1],  # status = 3 is '3 - Alpha'
                 'Intended Audience :: ' + cfg['audience'].title(),
                 'Natural Language :: ' + cfg['language'].title()] +
                ['Programming Language :: Python :: ' + o for o in py_versions[py_versions.index(min_python):]],
    packages=setuptools.find_packages(include=[cfg['lib_path'], cfg['lib_path'] + '.*']),
    install_requires=cfg['requirements'].split(),
    extras_require={**extras, 'dev': cfg['dev_requirements'].split() + [r for rs in extras.values() for r in rs]},
    python_requires='>=' + min_python,
    long_description=readme.read_text(encoding='utf-8') if readme.exists() else cfg['description'],
    long_description_content_type='text/markdown',
    include_package_data=True, zip_safe=False,
    entry_points={'nbdev': [f"{cfg['lib_path']}={cfg['lib_path']}._modidx:d"]},
)
