"""kvheat.heat"""
