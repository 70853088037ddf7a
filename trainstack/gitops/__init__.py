"""GitOps: what merging a change would deploy, and what it would cost.

Owns the plan diff of every deploy target between the working tree and a git ref (`gitdiff`), the
CloudFormation template diff of infrastructure changes (`template_diff`) and their rendering for a pull
request or a terminal (`report`). May import `planner`, `recipes` and `errors`.
"""
