"""The course's own tooling: what runs, reports and grades the chapters, not what they teach.

- ``report``: ``record(key, value)``, a notebook's claim written where the tests read it (every chapter);
- ``plots``: the course's figures, and ``save`` where the report collects them (every chapter);
- ``runner``: ``course run``, the notebooks executed with papermill, their results and ``report.md``;
- ``bench``: ``course bench``, the ``benchmarks/`` ratios in one table;
- ``site``: ``course site``, a static HTML version of the executed course;
- ``grading/``: the exercises made from the solutions, graded in a sandboxed kernel, and the learner's copy;
- ``cli``: the ``course`` command that dispatches to all of these.

Importing this package imports none of them: a learner's kernel reaches ``grading.checks`` cheaply.
"""
