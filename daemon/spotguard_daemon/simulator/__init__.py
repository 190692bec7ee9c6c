"""Faithful local metadata endpoints for AWS, GCP, Azure and Alibaba, with a control API."""
