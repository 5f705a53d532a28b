"""Fixed benchmark prompts. They were written for edgespec and are not part of any training
corpus the default pair uses (the Python standard library's own source)."""

CODE_PROMPTS = (
    'def parse_config(path):\n    """Read a key=value configuration file into a dict."""\n    result = {}\n    with open(path) as f:\n',
    "class LRUCache:\n    def __init__(self, capacity):\n        self.capacity = capacity\n        self.data = {}\n\n    def get(self, key):\n",
    "import os\nimport sys\n\n\ndef main(argv=None):\n    if argv is None:\n        argv = sys.argv[1:]\n",
    "    def __repr__(self):\n        return '%s(%r)' % (self.__class__.__name__,",
    "def merge_sorted(a, b):\n    i = j = 0\n    out = []\n    while i < len(a) and j < len(b):\n",
    'class Matrix:\n    """A small dense matrix of floats."""\n\n    def __init__(self, rows, cols):\n        self.rows = rows\n',
    "    try:\n        value = int(text)\n    except ValueError:\n",
    "def tokenize(source):\n    tokens = []\n    for line in source.splitlines():\n        if not line.strip():\n",
)
