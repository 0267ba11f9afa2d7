"""kvheat.engine"""
