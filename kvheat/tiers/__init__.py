"""kvheat.tiers"""
